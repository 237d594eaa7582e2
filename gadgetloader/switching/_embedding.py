"""A drop-in embedding whose table (and optimizer state) stay off the GPU.

``OffloadedEmbedding`` / ``OffloadedEmbeddingBag`` are used like ``nn.Embedding`` /
``nn.EmbeddingBag`` inside any model. Each forward call gathers the batch's distinct
rows from the table into a small leaf tensor and looks them up with local ids;
``OffloadedOptimizer`` wraps any supported torch optimizer and, in ``step()``, pages
those rows and their optimizer state in, runs the torch step, and writes both back.
The user's loop is only forward / backward / ``step()``.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the torch idiom)
from torch import nn

from .._device import cuda_available, cupy_available, resolve_device, user_stacklevel
from .._dtypes import as_torch_dtype, dtype_name
from .._errors import GadgetError, GadgetTypeError, GadgetValueError, as_choice, as_count, as_flag
from .._ids import _to_tensor, as_ids, range_check_of
from ..gadget import DataGadget, as_tensor_data
from ..stores._base import FusedRows
from ..stores._base import gather_many as gather_stores
from . import _graphs as _captured
from ._optim import (
    StatePager,
    _filled_groups,
    check_optimizer_kind,
    check_optimizer_state,
    keep_saved_scalar_dtypes,
    optimizer_kind,
    optimizer_tags,
    probe_state,
    supported_name,
)
from ._rows import RowPlan, check_training_placement, exact_plan, plan_rows, plan_rows_async
from ._torchfile import table_tensor

__all__ = ["OffloadedEmbedding", "OffloadedEmbeddingBag", "OffloadedOptimizer"]

_BAG_MODES = ("sum", "mean", "max")


def _eager_under_compile(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``forward`` run eagerly where ``torch.compile`` traces a model holding the module.

    A lookup is host work (ids planned and checked on the CPU, rows paged in, a pending
    step recorded) that no graph can hold: traced, it broke the graph at its first
    ``.item()`` (with a warning), then at every later host step inside the library. Under
    ``torch.compile`` it is now one clean break: the lookup runs as
    ``torch.compiler.disable`` makes it, and its output is an input of the compiled rest.
    The wrapper is made the first time a call sees TorchDynamo imported (``torch.compile``
    imports it), so importing gadgetloader or running eagerly never imports it (~1 s)."""
    disabled: list[Callable[..., torch.Tensor]] = []

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "torch._dynamo" not in sys.modules:
            return forward(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(forward))
        return disabled[0](*args, **kwargs)

    return call


class _Lookup(torch.autograd.Function):
    """``rows[local]`` whose backward sums the gradient rows with the plan's sorted order
    (:func:`~gadgetloader.transfer._kernels.launch_segment_sum`): the same sums, in the
    same order, as ``F.embedding``'s CUDA backward, without its synchronisations."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, local: torch.Tensor, plan: RowPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        # gathered into a tensor of the output's shape (not returned as a view of one), so
        # in-place ops on the lookup's output work as on nn.Embedding's (torch refuses them
        # on a view made inside a custom Function)
        out = rows.new_empty((*local.shape, rows.shape[1]))
        torch.index_select(rows, 0, local.reshape(-1), out=out.view(-1, rows.shape[1]))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        from ..transfer._kernels import launch_segment_sum

        plan: RowPlan = ctx.plan
        assert plan.order is not None and plan.order_local is not None
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        out = torch.empty_like(g)
        launch_segment_sum(g, plan.order, plan.order_local, out)
        return out, None, None


def _lookup(local: torch.Tensor, rows: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``F.embedding(local, rows)``; for a plan sized on the GPU (float32/float64 rows) with
    a backward that needs no synchronisation."""
    if (
        plan.order is not None
        and rows.is_cuda
        and rows.dtype in (torch.float32, torch.float64)
        and rows.shape[0] == local.numel()
    ):
        return _Lookup.apply(rows, local, plan)
    return F.embedding(local, rows)


def _plans_on_device(ids: torch.Tensor) -> bool:
    """Whether a lookup of ``ids`` builds its row plan on the device (no synchronisation):
    CUDA ids (not ROCm: the backward copies CUDA's summation order) with the row kernels
    available (they read the plan's count on the GPU)."""
    return ids.is_cuda and torch.version.hip is None and cupy_available()


#: a plan sized on the GPU gives the per-step variable one row per lookup position; above
#: this many bytes of such rows (per tensor: rows, gradient, each optimizer state) a lookup
#: takes the exact plan instead (one synchronisation), so padding never costs much memory
DEVICE_PLAN_MAX_BYTES = 64 << 20


#: plain attribute assignment for the per-step bookkeeping of a module: it skips
#: ``nn.Module.__setattr__``'s parameter / buffer / submodule checks (several per step)
_set = object.__setattr__


class _Slot:
    """Holds the per-step parameter outside nn.Module's parameter registry, so
    ``model.parameters()`` (and any ordinary optimizer) never sees it."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param


class _OffloadedTable(nn.Module):
    """Common part: the table, the per-step variable, the pending rows of this step."""

    #: whether lookups may use plans sized on the GPU (see :func:`plan_rows_async`)
    _device_plans = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        placement: str | None,
        *,
        dtype: Any,
        device: Any,
        init: Callable[..., Any] | None,
    ) -> None:
        super().__init__()
        if placement is None:  # the default: no fallback warning on a machine without CUDA
            placement = "pinned" if cuda_available() else "cpu"
        self.num_embeddings = as_count(num_embeddings, "num_embeddings")
        self.embedding_dim = as_count(embedding_dim, "embedding_dim")
        self.compute_device = resolve_device(device)
        td = as_torch_dtype(dtype)
        if not td.is_floating_point:
            raise GadgetTypeError(
                f"an embedding table needs a floating-point dtype (float32, float16, bfloat16, "
                f"float64); got {dtype_name(td)}"
            )
        check_training_placement(placement, type(self).__name__)
        self.table = DataGadget(
            shape=(self.num_embeddings, self.embedding_dim),
            dtype=td,
            placement=placement,
            device=self.compute_device,
        )
        self.table.__dict__["_owner"] = weakref.ref(self)  # for DataGadget.requires_grad
        if init is None:
            self.table.normal_(0.0, 1.0)
        else:
            self.table.init_(init)
        self._slot = _Slot(
            nn.Parameter(torch.empty((0, self.embedding_dim), dtype=td, device=self.compute_device))
        )
        self._pending: list[tuple[RowPlan, torch.Tensor]] = []
        #: by id() of a pending lookup's rows: (backward pass, arrival number) of each
        #: gradient accumulated into them, so a step with several lookups sums them in the
        #: order torch's autograd would have summed them into one parameter
        self._arrivals: dict[int, list[tuple[int, int]]] = {}
        #: range checks of CUDA ids of training lookups, finished (raising on a bad id)
        #: before the step writes anything
        self._checks: list[Callable[[], None]] = []
        #: the optimizer-state tables interleaved with the table (set by OffloadedOptimizer):
        #: a training forward then gathers each row's states with it, in the same wide read
        self._state_stores: list[Any] | None = None
        #: states gathered by a forward, by id() of its rows tensor, until the step, with the
        #: state pager's generation then (a refill since makes them stale)
        self._forward_states: dict[int, tuple[list[torch.Tensor], int]] = {}
        #: the optimizer's state pager of this table (set by OffloadedOptimizer)
        self._state_pager: Any = None
        #: the states of this step's rows when one forward gathered them all, with the state
        #: pager's generation then (a refill since makes them stale)
        self._prefetched: tuple[list[torch.Tensor], int] | None = None
        #: the plan of the rows merged into the per-step parameter by this step's last
        #: merge (their gradient is ``param.grad`` from then on, as the user left it), or None
        self._merged: RowPlan | None = None
        #: the state pager's layout version the state stores above were listed at
        self._state_version = 0
        #: (device, prepared transfer) of the stores a training lookup gathers
        self._fused: tuple[torch.device, FusedRows] | None = None
        #: captured CUDA graphs of training lookups over ``_fused`` (see ``_graphs``)
        self._graphs: _captured.LookupGraphs | None = None
        self._attached = False
        #: rows of training lookups that had no gradient when the last step ran: a gradient
        #: arriving later is reported by the next step (it would be lost silently)
        self._late: bool | str = False  # or the cause ("step", "load") of a late gradient

    #: set by ``requires_grad_(False)``: lookups are then constants (the table is frozen)
    _frozen = False
    #: (an instance's own once a training lookup ran on a CUDA device; see ``_graphs``)
    _graphs: _captured.LookupGraphs | None = None
    #: set by ``.to(dtype)`` / ``.half()`` / ``.double()``: the dtype lookups are returned in
    _out_dtype: torch.dtype | None = None

    @property
    def placement(self) -> str:
        """Where the table's rows live (``'pinned'``, ``'cuda'``, ``'cpu'``, ``'file'``)."""
        return self.table.placement

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        table = self.__dict__.get("table")
        if table is not None:  # a copy's table answers to the copy (its own table)
            table.__dict__["_owner"] = weakref.ref(self)

    def requires_grad_(self, requires_grad: bool = True) -> _OffloadedTable:
        """``requires_grad_(False)`` freezes the table, as for ``nn.Embedding``: lookups
        return constants, and the optimizer leaves the table and its state alone;
        ``requires_grad_(True)`` (the default ``requires_grad``) trains it again."""
        _set(self, "_frozen", not requires_grad)
        return super().requires_grad_(requires_grad)  # type: ignore[return-value]

    def _deliver(self, out: torch.Tensor) -> torch.Tensor:
        """A lookup's result in the dtype the module was converted to (if it was)."""
        want = self._out_dtype
        return out if want is None or out.dtype == want else out.to(want)

    def _apply(self, fn: Any, recurse: bool = True) -> _OffloadedTable:
        """``model.to(device)`` / ``.cuda()`` / ``.cpu()`` move where lookups are delivered
        and where the step runs; the table itself stays in its placement."""
        out = super()._apply(fn, recurse)
        cur = self._out_dtype or self.table.dtype
        probe = fn(torch.empty(0, dtype=cur, device=self.compute_device))
        if isinstance(probe, torch.Tensor) and probe.dtype != cur and probe.is_floating_point():
            # .half() / .double() / .to(dtype): lookups come back in that dtype (their
            # gradients go back in the table's); the table keeps its dtype
            _set(self, "_out_dtype", None if probe.dtype == self.table.dtype else probe.dtype)
        if isinstance(probe, torch.Tensor) and probe.device != self.compute_device:
            self.compute_device = probe.device
            param = self._slot.param
            param.data = param.data.to(probe.device)
            self._pending.clear()
            self._arrivals.clear()
            self._forward_states.clear()
            self._prefetched = None
            self._merged = None
            # this step's lookups are dropped; their range checks stay queued, so a bad id
            # among them is still reported by the optimizer's next step() / zero_grad()
        return out

    @property
    def weight(self) -> DataGadget:
        """The full table (a :class:`~gadgetloader.DataGadget`). As for ``nn.Embedding``,
        ``emb.weight.requires_grad = False`` freezes it (``emb.requires_grad_(False)``)."""
        table = self.table
        owner = table.__dict__.get("_owner")
        if owner is None or owner() is None:  # (set when built; a copy's table gets it here)
            table.__dict__["_owner"] = weakref.ref(self)  # for DataGadget.requires_grad
        return table

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Throw away the gradients of this module's lookups since the last step (as
        ``nn.Embedding.zero_grad()`` does its weight's); the optimizer's ``zero_grad()`` does
        this for every table it trains. A parent module's ``zero_grad()`` does not reach
        these lookups (they are not parameters): call the optimizer's."""
        super().zero_grad(set_to_none)
        self._clear_grads()
        self._slot.param.grad = None  # a merge's gradient too: torch's step then skips it
        try:
            self._finish_checks()  # a bad id in the discarded lookups is reported now
        except Exception:
            self._drop_step()
            raise

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, placement={self.placement!r}, "
            f"dtype={dtype_name(self.table.dtype)}, device={str(self.compute_device)!r}"
            + (f", output_dtype={dtype_name(self._out_dtype)}" if self._out_dtype else "")
        )

    def _rows_for(self, input: Any) -> tuple[torch.Tensor, torch.Tensor, RowPlan]:
        """Local ids (input's shape), the leaf tensor of the distinct rows, and the plan.

        On a CUDA device the plan is built on the GPU (:func:`plan_rows_async`) and the
        rows are gathered with no synchronisation; the range check of CUDA ids is queued
        and, for a training lookup, finished by the optimizer's ``step()`` before anything
        is written (an eval lookup finishes it at once).
        """
        # (a torch tensor's __cuda_array_interface__ raises off CUDA, not only for the CPU)
        cuda_input = (
            input.is_cuda
            if isinstance(input, torch.Tensor)
            else hasattr(input, "__cuda_array_interface__")
        )
        ids = as_ids(input, self.num_embeddings, self.compute_device, check=False)
        store = self.table.store
        training = torch.is_grad_enabled() and self._attached and not self._frozen
        stores = [store, *self._state_stores] if training and self._state_stores else [store]
        finish = None
        replayed = None
        if (
            self._device_plans
            and _plans_on_device(ids)
            and ids.numel() * store.row_nbytes <= DEVICE_PLAN_MAX_BYTES
        ):
            replayed = self._replay(ids, stores) if training else None
            if cuda_input and ids.is_cuda and ids.numel():  # CPU ids were checked by as_ids
                # the plan's sort finds the smallest and largest id anyway: they travel to
                # this pair while the rest of the step is queued
                ends = torch.empty(2, dtype=torch.int64, pin_memory=True)
                if replayed is not None:
                    ends.copy_(replayed[2], non_blocking=True)
                    plan = replayed[0]
                else:
                    plan = plan_rows_async((ids,), self.num_embeddings, ends)
                done = torch.cuda.current_stream(ids.device).record_event()
                finish = range_check_of(ends, self.num_embeddings, done)
            elif replayed is not None:
                plan = replayed[0]
            else:
                plan = plan_rows_async((ids,), self.num_embeddings)
        else:
            plan = plan_rows((ids,), "merge", self.num_embeddings)
        fused = None
        if replayed is None and plan.n_distinct is not None:
            fused = self._fused_rows(stores)
        if replayed is not None:
            rows, *states = replayed[1]
        elif fused is not None and plan.n_distinct is not None:
            rows, *states = fused.gather(plan.ids, plan.n_distinct)
        else:
            if finish is not None:
                # no row kernel to keep bad ids inside the table (a host store, say): check
                # now (this path reads the count back anyway)
                finish()
                finish = None
            rows, *states = gather_stores(
                stores,
                plan.ids.to(store.ids_device(self.compute_device)),
                self.compute_device,
                ids_sorted=plan.distinct,
                count=plan.n_distinct,
            )
        if training:
            if finish is not None:
                self._checks.append(finish)
            rows.requires_grad_(True)
            self._pending.append((plan, rows))
            rows.register_post_accumulate_grad_hook(
                functools.partial(_arrived, weakref.ref(self), id(rows))
            )
            if states:
                gen = self._state_pager.generation if self._state_pager is not None else 0
                self._forward_states[id(rows)] = (states, gen)
        elif finish is not None:
            finish()
        return plan.local.view(ids.shape), rows, plan

    def _replay(
        self, ids: torch.Tensor, stores: list[Any]
    ) -> tuple[RowPlan, list[torch.Tensor], torch.Tensor] | None:
        """The plan and rows of ``ids`` from a captured CUDA graph (see ``_graphs``), or
        None where the lookup runs eagerly."""
        if not _captured.ENABLED or not ids.is_cuda or torch.is_inference_mode_enabled():
            return None
        graphs = self._graphs
        if graphs is None or graphs.fused.device != ids.device or not graphs.fused.matches(stores):
            # (the graphs keep their own transfer: an evaluation lookup between steps, which
            # moves the table alone, rebuilds the cached one but must not drop the graphs)
            fused = self._fused_rows(stores)
            if fused is None or fused.device != ids.device:
                return None
            graphs = _captured.LookupGraphs(fused)
            _set(self, "_graphs", graphs)
        return graphs.run(ids)

    def _fused_rows(self, stores: list[Any]) -> FusedRows | None:
        """The prepared fused transfer of ``stores`` (rebuilt when they change)."""
        cached = self._fused
        if cached is not None and cached[0] == self.compute_device and cached[1].matches(stores):
            return cached[1]
        fused = FusedRows.of(stores, self.compute_device)
        self._fused = None if fused is None else (self.compute_device, fused)
        return fused

    def _finish_checks(self) -> None:
        """Finish the pending range checks of this step's lookups (raises on a bad id)."""
        checks = list(self._checks)
        self._checks.clear()
        for finish in checks:
            finish()

    # ---- used by OffloadedOptimizer ------------------------------------------------
    def _has_unmerged_grads(self) -> bool:
        """True if a lookup of this step got gradient since the last merge (or ever)."""
        return any(rows.grad is not None for _, rows in self._pending)

    def _end_step(self, cause: str = "step") -> None:
        """After the step (``cause`` "step") or before a load of the table's rows ("load"):
        this step's lookups are retired (a gradient reaching them later is reported by the
        next step, naming the cause) and, with their gathered states, forgotten."""
        # every lookup of the step gets a hook: a gradient that reaches it later (any number
        # of steps later, or more gradient for one that had some) marks the table, and the
        # next merge reports it unless zero_grad() threw it away first, as torch would
        ref = weakref.ref(self)
        for _, rows in self._pending:
            if rows.requires_grad:
                rows.register_hook(functools.partial(_mark_late, ref, cause))
        self._pending.clear()
        self._arrivals.clear()
        self._forward_states.clear()
        _set(self, "_prefetched", None)
        _set(self, "_merged", None)

    def _take_step_rows(self, sparse: bool) -> RowPlan | None:
        """Merge this step's forward calls into the per-step parameter and its gradient.

        A merge takes the lookups' gradients over: they are cleared, so a backward after
        it (gradient accumulation with ``param_groups`` read in between) puts only its own
        gradient there, and the next merge adds it to ``param.grad`` as the user left it
        (clipped or unscaled in place, replaced, or set to None), exactly as torch adds a
        backward's gradient to a dense parameter's ``.grad``."""
        pending = [(plan, rows) for plan, rows in self._pending if rows.grad is not None]
        forward_states = self._forward_states
        _set(self, "_prefetched", None)
        param = self._slot.param
        base = self._merged_rows()
        if not pending and base is None:
            param.grad = None
            return None
        if len(pending) == 1 and base is None:
            plan, rows = pending[0]
            # one forward gathered exactly this step's rows: its state rows are current
            # unless the state tables were refilled or grew since (see StatePager.follow_hyper)
            got = forward_states.get(id(rows))
            if got is not None:
                _set(self, "_prefetched", got)  # (states, pager generation when gathered)
            data, grad = rows.detach(), rows.grad
        else:
            # several lookups this step, or gradient merged before: merge the rows (their
            # counts read back)
            parts = [] if base is None else [base]
            for plan, rows in pending:
                k = plan.num_rows if plan.n_distinct is None else exact_plan(plan).num_rows
                assert rows.grad is not None
                parts.append((plan.ids[:k], rows.detach()[:k], rows.grad[:k]))
            all_ids = torch.cat([ids for ids, _, _ in parts])
            uniq, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
            data = torch.empty(
                (uniq.numel(), self.embedding_dim), dtype=param.dtype, device=param.device
            )
            wheres = []
            start = 0
            for ids, data_k, _ in parts:
                where = inverse[start : start + ids.numel()]
                start += ids.numel()
                data.index_copy_(0, where, data_k)
                wheres.append(where)
            grads = [grad_k for _, _, grad_k in parts]
            if base is None:
                grad = _sum_lookups(self._passes(pending), wheres, grads, data)
            else:
                # the merged gradient first, then each backward pass's sum added to it in
                # turn (rows a pass did not reach add zero), as torch accumulates a dense .grad
                start = torch.zeros_like(data)
                start.index_copy_(0, wheres[0], grads[0])
                grad = _sum_lookups(self._passes(pending), wheres[1:], grads[1:], data, start)
            plan = RowPlan(uniq, inverse, ((all_ids.numel(),),), True)
        assert grad is not None
        param.data = data
        if sparse:
            n = data.shape[0]
            idx = torch.arange(n, device=data.device).unsqueeze(0)
            param.grad = torch.sparse_coo_tensor(
                idx, grad, data.shape, is_coalesced=True, check_invariants=False
            )
        else:
            param.grad = grad
        # the lookups' gradients are the parameter's now
        for _, rows in pending:
            rows.grad = None
        self._arrivals.clear()
        _set(self, "_merged", plan)
        return plan

    def _merged_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The rows merged before in this step (ids, values, gradient as ``param.grad``
        holds it now), or None where nothing was merged or the gradient was set to None."""
        plan = self._merged
        param = self._slot.param
        grad = param.grad
        if plan is None or grad is None:
            return None
        k = plan.num_rows if plan.n_distinct is None else exact_plan(plan).num_rows
        data = param.detach()
        if grad.is_sparse:  # (torch keeps a .grad the parameter's shape and dtype)
            grad = grad.to_dense()
        return plan.ids[:k], data[:k], grad[:k]

    def _step_plan(self) -> RowPlan | None:
        """The rows this step updates when no backward came since the last merge: the
        merged ones, unless their gradient was set to None since."""
        return self._merged if self._slot.param.grad is not None else None

    def _blocks_load(self) -> bool:
        """Before the table's rows are replaced: True if a lookup with a gradient waits for its
        step (the step would write the rows it read over the load). Lookups without a
        gradient are retired now (a gradient reaching them later is reported as late)."""
        if self._has_pending_grads():
            return True
        if self._pending:
            self._end_step("load")
        return False

    def _check_retired(self) -> None:
        """Raise if a lookup made before a step got (more) gradient after that step."""
        cause = self._late
        if cause:
            _set(self, "_late", False)
            if cause == "load":
                raise GadgetValueError(
                    "a lookup of this offloaded embedding made before its rows were loaded "
                    "(load_state_dict / load_checkpoint) got gradient after the load: its rows "
                    "were read before the load replaced them, and the gradient is dropped; run "
                    "backward() and step() before loading, or load before the forward"
                )
            raise GadgetValueError(
                "a lookup of this offloaded embedding made before a step() got (more) "
                "gradient after that step: its rows were read before the step changed them, "
                "and the gradient is dropped; run backward() before step() for every "
                "training forward (or make forwards that are not trained under torch.no_grad())"
            )

    def _has_pending_grads(self) -> bool:
        """True if a lookup of this step has gradient: unmerged, or merged before."""
        return self._merged is not None or self._has_unmerged_grads()

    def _passes(self, pending: list[tuple[RowPlan, torch.Tensor]]) -> list[list[int]] | None:
        """The lookups of ``pending`` (indices) by backward pass: lookups in the order their
        gradients arrived, passes in the order each one's last gradient arrived; None where a lookup's gradient did not come from
        exactly one recorded pass (it was accumulated over several, or set by hand)."""
        first: list[tuple[int, int, int]] = []  # (arrival, pass, lookup)
        for k, (_, rows) in enumerate(pending):
            got = self._arrivals.get(id(rows))
            if got is None or len(got) != 1:
                return None
            task, seq = got[0]
            first.append((seq, task, k))
        passes: dict[int, list[int]] = {}
        last: dict[int, int] = {}  # each pass's last arrival
        for seq, task, k in sorted(first):
            passes.setdefault(task, []).append(k)
            last[task] = seq
        # a dense weight gets a pass's sum once the pass's last use has arrived (its
        # AccumulateGrad runs then), so the passes go in that order: a reentrant
        # checkpoint's inner pass, run in the middle of the outer one, comes first
        return [passes[task] for task in sorted(passes, key=last.__getitem__)]

    def _drop_step(self) -> None:
        """Forget this step's lookups (after a bad id was reported)."""
        self._pending.clear()
        self._arrivals.clear()
        self._forward_states.clear()
        self._checks.clear()
        _set(self, "_prefetched", None)
        _set(self, "_merged", None)

    def _release(self) -> None:
        """Forget the optimizer this table belonged to (it is gone): a new one may attach."""
        _set(self, "_attached", False)
        _set(self, "_state_stores", None)
        _set(self, "_state_pager", None)
        _set(self, "_fused", None)
        _set(self, "_graphs", None)
        self._drop_step()
        _set(self, "_late", False)

    def __copy__(self) -> Any:
        # a shallow copy would share the table, its optimizer state and the step in flight
        # with this module, yet look unowned: a second optimizer could take the same rows
        raise GadgetTypeError(
            f"copy.copy of an {type(self).__name__} would share its table (and the state "
            "of the optimizer that trains it) with the original; use copy.deepcopy (a "
            "separate table with no optimizer) or the original module"
        )

    def __getstate__(self) -> dict[str, Any]:
        # a copy (copy.deepcopy, pickling) has the rows but no optimizer and no step in flight
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state.update(
            _attached=False,
            _state_stores=None,
            _state_pager=None,  # the optimizer's (its inner optimizer, state tables)
            _state_version=0,
            _merged=None,
            _fused=None,
            _graphs=None,
            _pending=[],
            _arrivals={},
            _checks=[],
            _forward_states={},
            _prefetched=None,
            _late=False,
        )
        return state

    def _clear_grads(self) -> None:
        for _, rows in self._pending:
            rows.grad = None
        self._arrivals.clear()
        _set(self, "_merged", None)
        _set(self, "_late", False)  # a late gradient is thrown away, as torch's zero_grad would

    # ---- state_dict: the full table, for small tables --------------------------------
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not _EXTERNAL_TABLES:
            destination[prefix + "weight"] = table_tensor(self.table)  # its own dtype

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        if key in state_dict:
            t = state_dict[key]
            if isinstance(t, np.ndarray):
                try:  # any layout, byte order or read-only array (np.load(mmap_mode='r'))
                    t = as_tensor_data(t, key)
                except GadgetTypeError as exc:
                    t = exc
            if isinstance(t, GadgetTypeError):
                error_msgs.append(str(t))
            elif not isinstance(t, torch.Tensor):
                error_msgs.append(
                    f"{key}: expected a tensor or NumPy array, got {type(t).__name__}"
                )
            elif t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
                error_msgs.append(
                    f"{key}: expected a dense tensor with values, got a {t.layout} tensor on "
                    f"{t.device}"
                )
            elif not (t.is_floating_point() or t.dtype == self.table.dtype):
                error_msgs.append(f"{key}: expected floating-point values, got {t.dtype}")
            elif tuple(t.shape) != self.table.shape:
                error_msgs.append(
                    f"size mismatch for {key}: expected {self.table.shape}, got {tuple(t.shape)}"
                )
            elif self._blocks_load():
                error_msgs.append(
                    f"{key}: a training lookup of this table has its gradient and waits for "
                    "step() (its rows were read before this load and would overwrite it); load "
                    "before the forward or after step()"
                )
            else:
                self.table.store.write_block(0, t.to(self.table.dtype).cpu())
                self.table.store.synchronize()
        elif strict and not _EXTERNAL_TABLES:
            missing_keys.append(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key in unexpected_keys:
            unexpected_keys.remove(key)


#: set by the checkpoint code while it writes tables to files itself
_EXTERNAL_TABLES: list[bool] = []


class OffloadedEmbedding(_OffloadedTable):
    """``nn.Embedding`` with its table in a store (pinned host RAM by default).

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        The table's shape.
    placement : {'pinned', 'cuda', 'cpu'}, optional
        Where the table and its optimizer state live. Default: ``pinned`` where CUDA is
        available, else ``cpu`` (silently; ``cuda`` or ``pinned`` asked for by name on
        such a machine falls back to ``cpu`` with a ``FallbackWarning``, once a process).
    dtype : default float32
        A floating-point dtype (float16, bfloat16, float32, float64); an integer
        or bool dtype is a ``GadgetTypeError``, as torch's embeddings are trained.
    device : optional
        Where lookups are delivered and the optimizer step runs (default: the
        current CUDA device, else the CPU).
    init : callable, optional
        In-place initializer for the table (default N(0, 1) like ``nn.Embedding``),
        e.g. ``functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)``.

    Notes
    -----
    A forward call gathers the distinct rows of ``input`` once (repeats merged, so
    gradients of repeated ids add up exactly); train it with
    :class:`OffloadedOptimizer`. Several lookups in one step (and over several backward
    passes) are summed in the order torch's autograd sums several uses of one parameter,
    bit-identical to a dense ``nn.Embedding`` (exact to rounding only where one lookup's
    output gets gradient from more than one backward pass).

    With CUDA ids on a CUDA device (and CuPy) a training step never drains the GPU's
    queue: the row plan (sort, distinct ids, local ids) is built on the GPU and its row
    count stays there (the per-step variable has one row per lookup position, up to
    64 MiB of rows; rows past the distinct ones are zeros that are
    never written back; larger lookups take an exact plan, one synchronisation), and the
    backward sums the gradients of repeated ids with a kernel in the same order as
    ``F.embedding``'s CUDA backward (bit-identical results). Only ``step()`` waits, for the
    forward's plan (long finished by then): the range check of CUDA ids finishes in
    ``step()`` (or ``prepare_grads()`` / ``zero_grad()``), before anything is written: a
    training forward with an id out of range returns zeros for it, and the step raises
    :class:`~gadgetloader.GadgetIndexError` leaving the table, its optimizer state and
    step counts unchanged (that step's lookups are dropped). Lookups made without
    gradients (``torch.no_grad()``, or before an optimizer is attached), lookups of a
    table without a GPU path (``cpu`` placement) and CPU ids are
    checked before the forward returns. The table is not an ``nn.Parameter``: a plain
    torch optimizer over ``model.parameters()`` does not see it. ``state_dict()``
    includes the whole table as ``weight`` (fine for small tables; use
    :func:`~gadgetloader.switching.save_checkpoint` for large ones). Forward
    calls made with gradients enabled keep their rows until the next
    ``step()``: evaluate under ``torch.no_grad()``. Under ``torch.compile`` the lookup
    runs eagerly (one graph break; the rest of the model is compiled). ``nn.Embedding``'s
    ``padding_idx``,
    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not taken (a ``TypeError``
    for the unknown keyword). Other differences from ``nn.Embedding``: a table has at
    least one row; ``load_state_dict`` also takes a NumPy array and refuses integer
    values for a float table (torch would convert them); ``repr`` shows the table's
    dtype and, after ``.half()`` / ``.double()`` / ``.to(dtype)``, the lookups'
    ``output_dtype``.

    On a CUDA device a training lookup's plan and gather (a sort, the plan kernel, the
    fused gather of the rows and their optimizer states: most of a step's CPU time) are
    captured into a CUDA graph the second time a lookup of the same id count is seen,
    and replayed from then on (one launch; bit-identical results). Each id count keeps
    up to two captured copies (a step's outputs stay in use until the next step), at
    most four counts and 512 MiB of captured outputs per table; a copy whose outputs are
    still referenced is never replayed over (the lookup then runs eagerly). Set the
    environment variable ``GADGETLOADER_CUDA_GRAPHS=0`` (or ``false``, ``no``, ``off``)
    before gadgetloader is imported to turn this off (it is read once, at import).

    Examples
    --------
    >>> import torch, gadgetloader as gl
    >>> emb = gl.OffloadedEmbedding(1000, 8, placement="cpu", device="cpu")
    >>> opt = gl.OffloadedOptimizer(torch.optim.Adam, emb, lr=0.01)
    >>> emb(torch.tensor([[1, 2], [2, 3]])).sum().backward()
    >>> opt.step()
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        placement: str | None = None,
        *,
        dtype: Any = torch.float32,
        device: Any = None,
        init: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, placement, dtype=dtype, device=device, init=init
        )

    @_eager_under_compile
    def forward(self, input: Any) -> torch.Tensor:
        local, rows, plan = self._rows_for(input)
        return self._deliver(_lookup(local, rows, plan))


def _on_cpu_or_cuda(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` itself if it lies on the CPU or a CUDA device (where a bag can use it)."""
    if t.device.type not in ("cpu", "cuda"):
        raise GadgetTypeError(f"{name} must be on the CPU or a CUDA device; got {t.device}")
    return t


class OffloadedEmbeddingBag(_OffloadedTable):
    """``nn.EmbeddingBag`` (``mode`` 'sum', 'mean' or 'max') with its table in a store.

    ``forward(input, offsets=None, per_sample_weights=None)`` takes a 2-D input
    (one bag per row, whatever ``include_last_offset`` says, as torch >= 2.5; with no
    columns, empty bags: zeros) or a 1-D input with ``offsets``, as ``nn.EmbeddingBag``.
    Parameters otherwise as :class:`OffloadedEmbedding`. Lookups use exact row plans
    (one synchronisation each): bags are long, and a plan sized on the GPU would give
    the per-step variable one row per bag entry; torch's bag backward synchronises anyway.
    ``offsets`` (int64 or int32, 1-D) must start at 0, never decrease and not pass the
    input's length (end at it with ``include_last_offset``); empty offsets go only with
    an empty input (no bags: a ``(0, embedding_dim)`` result, as torch's), and ``per_sample_weights``
    must be a float tensor of the input's shape (any floating dtype: it is cast to the
    table's, where torch's ``EmbeddingBag`` asks for the weight's own): both are checked before the lookup is
    recorded (CUDA offsets with one read-back), so a bad call leaves nothing for the step.
    ``nn.EmbeddingBag``'s ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` are not taken (a ``TypeError`` for the unknown keyword); the table's own
    gradient path is always the paged one.
    """

    _device_plans = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mode: str = "mean",
        placement: str | None = None,
        *,
        include_last_offset: bool = False,
        dtype: Any = torch.float32,
        device: Any = None,
        init: Callable[..., Any] | None = None,
    ) -> None:
        as_choice(mode, "mode", _BAG_MODES, error=GadgetValueError)
        as_flag(include_last_offset, "include_last_offset")  # before the table is allocated
        super().__init__(
            num_embeddings, embedding_dim, placement, dtype=dtype, device=device, init=init
        )
        self.mode = mode
        self.include_last_offset = bool(as_flag(include_last_offset, "include_last_offset"))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"

    def _check_bag_args(
        self, input: Any, offsets: Any, per_sample_weights: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not hasattr(input, "shape"):  # a list, range, int: checked as every id input is
            input = _to_tensor(input)  # (a GadgetTypeError for a string, None, a ragged list)
        shape = tuple(input.shape)
        n = math.prod(shape)
        if len(shape) == 2:
            if offsets is not None:
                raise GadgetValueError(
                    f"offsets go with a 1-D input; got a 2-D input of shape {shape} (one bag "
                    "per row) and offsets"
                )
        elif len(shape) == 1:
            if offsets is None:
                raise GadgetValueError(
                    "a 1-D input needs offsets (or pass a 2-D input: one bag per row)"
                )
            if isinstance(offsets, (str, bytes)):  # (torch.as_tensor: a raw TypeError)
                raise GadgetTypeError(
                    f"offsets must be a 1-D int64 (or int32) tensor of bag starts; got "
                    f"{type(offsets).__name__} {offsets!r:.40}"
                )
            try:
                offsets = torch.as_tensor(offsets)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise GadgetTypeError(
                    "offsets must be a 1-D int64 (or int32) tensor of bag starts; got "
                    f"{type(offsets).__name__} ({exc})"
                ) from exc
            offsets = _on_cpu_or_cuda(offsets, "offsets")
            if offsets.dtype in (torch.int32, torch.int64) and offsets.dim() != 1:
                raise GadgetValueError(  # a shape: ValueError, as torch's EmbeddingBag
                    "offsets must be a 1-D int64 (or int32) tensor of bag starts; got "
                    f"{offsets.dtype} of shape {tuple(offsets.shape)}"
                )
            if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
                raise GadgetTypeError(
                    "offsets must be a 1-D int64 (or int32) tensor of bag starts; got "
                    f"{offsets.dtype} of shape {tuple(offsets.shape)}"
                )
            if offsets.numel() == 0 and (n or self.include_last_offset):
                raise GadgetValueError(
                    "offsets must hold at least one bag start"
                    + (
                        " (with include_last_offset, the end too)"
                        if self.include_last_offset
                        else ""
                    )
                    + f" for an input of {n} ids; got none"
                )
            ordered = True  # no offsets and no ids: no bags, a (0, embedding_dim) result
            if offsets.numel():
                off = offsets.to(torch.int64)
                first, last = off[0], off[-1]
                ordered = bool(
                    torch.stack(
                        (
                            first == 0,
                            (off[1:] >= off[:-1]).all(),
                            (last == n) if self.include_last_offset else (last <= n),
                        )
                    ).all()
                )  # one read-back for CUDA offsets
            if not ordered:
                end = f"end with {n}" if self.include_last_offset else f"not exceed {n}"
                raise GadgetValueError(
                    f"offsets must start at 0, never decrease and {end} (the input's length); "
                    f"got {offsets.tolist() if offsets.numel() <= 16 else 'offsets outside that'}"
                )
        else:
            raise GadgetValueError(
                f"input must be 1-D (with offsets) or 2-D (one bag per row); got shape {shape}"
            )
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise GadgetValueError(
                    f"per_sample_weights go with mode='sum' (as in torch's EmbeddingBag); this "
                    f"bag's mode is {self.mode!r}"
                )
            w = per_sample_weights
            if isinstance(w, torch.Tensor) and w.is_floating_point() and tuple(w.shape) != shape:
                raise GadgetValueError(  # a shape: ValueError, as torch's EmbeddingBag
                    f"per_sample_weights must be a floating-point tensor of the input's shape "
                    f"{shape}; got {w.dtype} of shape {tuple(w.shape)}"
                )
            if (
                not isinstance(w, torch.Tensor)
                or not w.is_floating_point()
                or tuple(w.shape) != shape
            ):
                got = (
                    f"{w.dtype} of shape {tuple(w.shape)}"
                    if isinstance(w, torch.Tensor)
                    else type(w).__name__
                )
                raise GadgetTypeError(
                    f"per_sample_weights must be a floating-point tensor of the input's shape "
                    f"{shape}; got {got}"
                )
            _on_cpu_or_cuda(w, "per_sample_weights")
        return offsets, per_sample_weights

    @_eager_under_compile
    def forward(
        self,
        input: Any,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # checked before the lookup is recorded: bad arguments leave no pending rows
        offsets, per_sample_weights = self._check_bag_args(input, offsets, per_sample_weights)
        local, rows, _ = self._rows_for(input)
        # include_last_offset describes offsets: a 2-D input is one bag per row whatever it
        # says (torch >= 2.5 ignores it there; torch 2.4 dropped the last bag, and crashed
        # for mode='max' when that left none)
        last_offset = self.include_last_offset and offsets is not None
        if offsets is not None:
            offsets = offsets.to(local.device)
        elif local.dim() == 2 and local.shape[1] == 0:
            # bags of no entries (torch's 2-D path fails on them: an arange of step 0):
            # the same bags as a 1-D input with offsets, which torch gives as zeros
            offsets = torch.zeros(local.shape[0], dtype=torch.int64, device=local.device)
            local = local.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        if per_sample_weights is not None:
            # weights in a converted module's dtype (.double()) are taken in the table's
            per_sample_weights = per_sample_weights.to(local.device, rows.dtype)
            if per_sample_weights.requires_grad and not rows.requires_grad:
                # torch < 2.5 fails an internal assert in embedding_bag's backward when only
                # the weights need a gradient: give the (constant) rows one to drop
                rows = rows.detach().requires_grad_()
        return self._deliver(
            F.embedding_bag(
                local,
                rows,
                offsets,
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=last_offset,
            )
        )


#: numbers the gradients accumulated into training lookups, in the order they arrive
_arrival = itertools.count()


def _arrived(ref: Any, key: int, rows: torch.Tensor) -> None:
    """After a backward accumulated a gradient into a training lookup's rows: note which
    pass (torch's graph task) and when, for :func:`_sum_lookups`."""
    m = ref()
    if m is not None:
        task = int(torch._C._current_graph_task_id())
        m._arrivals.setdefault(key, []).append((task, next(_arrival)))


def _sum_lookups(
    passes: list[list[int]] | None,
    wheres: list[torch.Tensor],
    grads: list[torch.Tensor],
    like: torch.Tensor,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's gradient of several lookups: lookup ``k``'s rows ``grads[k]`` go to the
    step's rows ``wheres[k]``. Summed in the order torch's autograd sums the gradients of
    several uses of one parameter (as a dense ``nn.Embedding``'s weight gets them): in a
    backward pass, the first to arrive as it is and each later one added to it; the pass's
    sum added to the gradient of the passes before it in ``passes`` (the order they
    finished: see :meth:`_OffloadedTable._passes`). ``passes`` None (unknown order): in
    the order of the lookups, from zero. ``start``: the gradient merged before (written
    into), to which the passes are added in turn."""
    if passes is None:
        total = torch.zeros_like(like) if start is None else start
        for k, grad in enumerate(grads):
            total.index_add_(0, wheres[k], grad)
        return total
    out: torch.Tensor | None = start
    for lookups in passes:
        buf = torch.zeros_like(like)
        for n, k in enumerate(lookups):
            if n == 0:
                buf.index_copy_(0, wheres[k], grads[k])
            else:
                buf.index_add_(0, wheres[k], grads[k])
        out = buf if out is None else out.add_(buf)
    assert out is not None
    return out


def _mark_late(ref: Any, cause: str, grad: torch.Tensor) -> None:
    """Gradient hook of a lookup retired by a step or a load (``cause``): the gradient came
    too late."""
    m = ref()
    if m is not None:
        _set(m, "_late", cause)


def _detach(refs: list[Any]) -> None:
    """Release tables from an optimizer that is gone (see OffloadedOptimizer.__init__)."""
    for ref in refs:
        m = ref()
        if m is not None:
            m._release()


class _Groups(list):  # type: ignore[type-arg]
    """An :class:`OffloadedOptimizer`'s ``param_groups``: walking or indexing it after a
    backward first merges the offloaded tables' pending row gradients into their per-step
    parameters, so whatever reads the groups (``GradScaler.unscale_`` / ``step``, gradient
    clipping over ``param_groups``) sees, unscales and checks them like any other gradient."""

    _owner: Any = None

    def _merge(self) -> None:
        opt = self._owner() if self._owner is not None else None
        if opt is not None:
            opt._auto_prepare()

    def __iter__(self) -> Any:
        self._merge()
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:  # opt.param_groups[0]["params"] too
        self._merge()
        return super().__getitem__(index)


def _refuse_unordered(x: Any, where: str) -> None:
    """A table (``emb.weight``) or a set where parameters are expected: refused before
    anything iterates it (a DataGadget iterates its rows; a set's order, and so which
    table each saved state loads into, changes between runs -- torch refuses sets too)."""
    if isinstance(x, DataGadget):
        raise GadgetTypeError(
            f"{where}: got a DataGadget (an offloaded embedding's table, emb.weight?); the "
            "table is not a parameter: pass the OffloadedEmbedding module itself (or the model "
            "holding it)"
        )
    if isinstance(x, (set, frozenset)):
        raise GadgetTypeError(
            f"{where}: optimizer parameters need to be in an ordered collection such as a "
            "list; the order of a set changes between runs (and with it which table each saved "
            "optimizer state is loaded into)"
        )


def _collect(
    params: Any,
) -> tuple[list[_OffloadedTable], list[Any], list[tuple[dict[str, Any], list[_OffloadedTable]]]]:
    """Split modules / parameters / param groups into offloaded tables and the rest.

    Returns the tables outside param-group dicts, the other parameters outside them, and
    each param-group dict (its ``params`` without tables) with the tables it names.
    Parameters a group names are left out of the modules given beside it, so
    ``[model, {"params": model.head.parameters(), "lr": 0.01}]`` works.
    """
    if isinstance(params, torch.Tensor):  # (as torch's optimizers refuse one)
        raise GadgetTypeError(
            "params must be a module, or an iterable of modules, parameters or param-group "
            f"dicts; got a single {type(params).__name__}: pass [tensor]"
        )
    if isinstance(params, (nn.Module, dict)):
        params = [params]
    _refuse_unordered(params, "params")
    try:
        items = list(params)
    except TypeError:
        raise GadgetTypeError(
            "OffloadedOptimizer takes a module, or an iterable of modules, parameters or "
            f"param-group dicts; got {type(params).__name__}"
        ) from None
    groups: list[tuple[dict[str, Any], list[_OffloadedTable]]] = []
    seen: set[int] = set()  # tables and parameters already placed

    def expand(x: Any, where: str) -> tuple[list[_OffloadedTable], list[Any]]:
        if isinstance(x, (nn.Module, torch.Tensor)):
            x = [x]
        _refuse_unordered(x, where)
        tables: list[_OffloadedTable] = []
        plain: list[Any] = []
        try:
            seq = list(x)
        except TypeError:
            raise GadgetTypeError(
                f"{where}: expected modules or parameters, got {type(x).__name__}"
            ) from None
        for item in seq:
            if isinstance(item, nn.Module):
                for m in item.modules():
                    if isinstance(m, _OffloadedTable) and id(m) not in seen:
                        seen.add(id(m))
                        tables.append(m)
                for p in item.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        plain.append(p)
            elif isinstance(item, torch.Tensor):
                if id(item) not in seen:
                    seen.add(id(item))
                    plain.append(item)
            else:
                _refuse_unordered(item, where)
                raise GadgetTypeError(
                    f"{where}: expected modules or parameters, got {type(item).__name__}"
                )
        return tables, plain

    # param-group dicts first: what they name is theirs, not the default group's
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if "params" not in item:
                raise GadgetValueError(f"param group {i} has no 'params' entry")
            claimed = set(seen)
            seen.clear()  # within one dict a repeat is merged; across dicts it is refused
            tables, plain = expand(item["params"], f"param group {i}")
            both = [x for x in (*tables, *plain) if id(x) in claimed]
            if both:
                what = (
                    f"the {type(both[0]).__name__}"
                    if isinstance(both[0], _OffloadedTable)
                    else f"a parameter of shape {tuple(both[0].shape)}"
                )
                raise GadgetValueError(
                    f"param group {i} names {what} that an earlier param group already "
                    "names; as in torch, a parameter (or an offloaded table) may not appear in more "
                    "than one param group"
                )
            seen.update(claimed)
            groups.append(({**item, "params": plain}, tables))
    rest_tables: list[_OffloadedTable] = []
    rest: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            continue
        if not isinstance(item, (nn.Module, torch.Tensor)):
            raise GadgetTypeError(
                "OffloadedOptimizer takes modules, parameters or param-group dicts; got "
                f"{type(item).__name__}"
            )
        tables, plain = expand(item, "params")
        rest_tables.extend(tables)
        rest.extend(plain)
    return rest_tables, rest, groups


class OffloadedOptimizer(torch.optim.Optimizer):
    """Any supported torch optimizer over models with offloaded embeddings.

    Parameters
    ----------
    optimizer_class : type
        A torch optimizer class, one of
        :data:`~gadgetloader.switching.SUPPORTED_OPTIMIZERS` (for ``SparseAdam`` the
        ordinary parameters must have sparse gradients too).
    params : nn.Module, or iterable of modules / parameters / param-group dicts
        Modules are searched for :class:`OffloadedEmbedding` /
        :class:`OffloadedEmbeddingBag`; their ordinary parameters are optimized
        as usual. A param-group dict may name offloaded modules in its ``params``
        (``{"params": model.emb, "lr": 0.5}``): their tables then take that group's
        options. What a dict names is left out of the modules given beside it, so
        ``[model, {"params": model.head.parameters(), "lr": 0.01}]`` works; everything
        not named by a dict shares one group with the keyword options, which comes last in
        ``param_groups`` (after the dicts, in their order, wherever the modules stood in
        ``params``: mind it for a scheduler given one value per group). Two dicts naming
        the same parameter or table are refused (``GadgetValueError``), as torch
        refuses them.
    **kwargs
        Passed to ``optimizer_class`` (``lr=``, ``betas=``, ``foreach=``, ``fused=``, ...).

    Notes
    -----
    ``step()`` runs one torch step over the ordinary parameters and, per offloaded
    table, over the distinct rows used since the last step (the gradients of all
    forward calls summed), with their optimizer state gathered from and scattered
    back to state tables in the table's placement. Rows not used are untouched,
    and each table keeps one step count, as torch's ``SparseAdam`` (a table with no
    lookup since the last step is not stepped, even where ``zero_grad(set_to_none=False)``
    would have left torch a zero gradient to count a step for). The wrapper is
    a ``torch.optim.Optimizer`` sharing ``param_groups`` and ``state`` with the
    inner optimizer, so learning-rate schedulers work.

    A ``pinned`` (or ``cpu``) table whose optimizer keeps row state (Adam's two
    moments, Adagrad's sum, ...) is moved, when the optimizer is built, into one
    buffer with its state tables, row ``i`` of each side by side; the table's
    :class:`~gadgetloader.DataGadget` stays the same object. A training forward
    then gathers each row's state with the row, and ``step()`` writes both back, as
    one wide row per id: one host-page translation per row instead of one per table
    (see DESIGN.md). The state tables are ``self.pagers[i].tables``.

    A table belongs to one optimizer at a time; when this optimizer is garbage
    collected its tables are released and a new ``OffloadedOptimizer`` may take them
    (with fresh optimizer state). A warning is given when ``params`` holds no offloaded
    table (``model.parameters()`` does not reach them: pass the model). A gradient that
    reaches a lookup after a ``step()`` that read it (any number of steps later) raises
    :class:`~gadgetloader.GadgetValueError` at the next ``step()`` (it is not applied),
    unless ``zero_grad()`` discards it first, as torch's would. Loading the table's rows
    (the embedding module's ``load_state_dict``, ``load_checkpoint``) while a lookup with a
    gradient waits for its step is refused: the step would write the rows it read over the
    load. This optimizer's own ``load_state_dict`` loads optimizer state only and is taken
    then (the next step starts from the loaded state). An empty lookup (no ids) with a
    backward counts as a lookup: its table's step count moves at the next step, as
    ``SparseAdam``'s does for an empty sparse gradient; no row changes.
    Fused SGD with momentum gives ordinary parameters in a table's parameter group a zero
    momentum buffer before their first step (exactly torch's first step when
    ``dampening`` is 0; refused otherwise), because torch's fused SGD needs buffers for all
    of a group's parameters or none; other groups step as torch steps them.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | nn.Module,
        **kwargs: Any,
    ) -> None:
        if isinstance(optimizer_class, torch.optim.Optimizer):
            raise GadgetTypeError(
                f"OffloadedOptimizer takes an optimizer class and its arguments, e.g. "
                f"OffloadedOptimizer(torch.optim.Adam, model, lr=1e-3); got an instance of "
                f"{type(optimizer_class).__name__} (its parameters cannot reach the tables)"
            )
        self.optimizer_name = supported_name(optimizer_class)
        rest_tables, plain, dict_groups = _collect(params)
        tables = [m for _, ts in dict_groups for m in ts] + rest_tables
        others = [p for g, _ in dict_groups for p in g["params"]] + plain
        if not tables and not others:
            raise GadgetValueError(
                "OffloadedOptimizer got no parameters and no offloaded embeddings (an "
                "offloaded table is not a parameter, so model.parameters() does not reach it: "
                "pass the model, or its embedding modules, instead)"
            )
        if not tables:
            warnings.warn(
                "OffloadedOptimizer found no OffloadedEmbedding / OffloadedEmbeddingBag: the "
                "tables are not parameters, so model.parameters() does not reach them; pass the "
                "model (or its embedding modules) instead",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        for m in tables:
            if m._attached:
                raise GadgetValueError(
                    "this offloaded embedding already belongs to an OffloadedOptimizer"
                )
        # each table's per-step parameter joins the group that named it (its own lr,
        # weight_decay, ...); the rest share one group with the ordinary parameters
        groups: list[dict[str, Any]] = [
            {**g, "params": g["params"] + [m._slot.param for m in ts]} for g, ts in dict_groups
        ]
        if plain or rest_tables or not groups:
            groups.append({"params": plain + [m._slot.param for m in rest_tables]})
        try:
            self.inner = optimizer_class(groups, **kwargs)
        except (TypeError, ValueError, IndexError, KeyError) as exc:  # torch's own checks
            # of lr=, betas=, ... (a betas of one number fails with an IndexError)
            if isinstance(exc, GadgetError):
                raise
            error = GadgetTypeError if isinstance(exc, TypeError) else GadgetValueError
            raise error(
                f"{optimizer_class.__name__} refused the options {sorted(kwargs)}: {exc}"
            ) from exc
        super().__init__([dict(g) for g in groups], dict(self.inner.defaults))
        self._share_groups()
        self.state = self.inner.state
        self.defaults = self.inner.defaults
        self.tables = tables
        self.pagers = [
            StatePager(
                self.inner, m._slot.param, m.num_embeddings, placement=m.placement, table=m.table
            )
            for m in tables
        ]
        self._sparse = self.optimizer_name == "SparseAdam"
        self._prepared: list[RowPlan | None] | None = None
        self._attach(tables, self.pagers)

    def _attach(self, tables: list[_OffloadedTable], pagers: list[StatePager]) -> None:
        for m, pager in zip(tables, pagers, strict=True):
            m._attached = True
            m._state_stores = (
                [t.store for t in pager.tables.values()] if pager.interleaved else None
            )
            m._state_pager = pager
        # when this optimizer is gone, its tables may get a new one (a later phase of
        # training, a fine-tune): they keep their rows, the new optimizer starts fresh state
        weakref.finalize(self, _detach, [weakref.ref(m) for m in tables])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group(param_group)``: a dict with ``params`` and this group's
        options. ``params`` may also name offloaded modules, whose
        tables then train with this group's options from fresh optimizer state (as a
        parameter added to a torch optimizer does)."""
        if "pagers" not in self.__dict__:  # torch's __init__ adding the first groups
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise GadgetTypeError(
                f"add_param_group takes a dict with a 'params' entry; got {type(param_group).__name__}"
            )
        _, _, groups = _collect([param_group])
        ((group, tables),) = groups
        for m in tables:
            if m._attached:
                raise GadgetValueError(
                    "this offloaded embedding already belongs to an OffloadedOptimizer"
                )
        if not tables and not group["params"]:
            raise GadgetValueError(
                "add_param_group got no parameters and no offloaded embeddings (an offloaded "
                "table is not a parameter, so model.parameters() does not reach it: pass the "
                "embedding modules instead)"
            )
        slots = [m._slot.param for m in tables]
        n_groups = list.__len__(self.inner.param_groups)
        self.inner.add_param_group({**group, "params": group["params"] + slots})
        try:
            # a pager probes the group's options with a fresh optimizer (torch checks
            # them only when one is built): a bad option must leave no group behind
            pagers = [
                StatePager(
                    self.inner,
                    m._slot.param,
                    m.num_embeddings,
                    placement=m.placement,
                    table=m.table,
                )
                for m in tables
            ]
        except BaseException:
            del self.inner.param_groups[n_groups:]
            for p in [*group["params"], *slots]:
                self.inner.state.pop(p, None)
            raise
        if self._prepared is not None:
            self._prepared = self._prepared + [None] * len(tables)
        self.tables = self.tables + tables
        self.pagers = self.pagers + pagers
        self._attach(tables, pagers)

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.inner!r}, offloaded tables={len(self.tables)})"

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer.__getstate__ would copy a shell without the inner optimizer and
        # the state tables, which fails later with AttributeErrors
        raise GadgetTypeError(
            "an OffloadedOptimizer cannot be copied or pickled (its state lives in the offloaded "
            "tables' stores); save it with state_dict() or gl.save_checkpoint() and build a new "
            "OffloadedOptimizer over the copied model to load it into"
        )

    #: set while prepare_grads runs (it must not start itself through param_groups)
    _preparing = False

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Merge each offloaded table's row gradients into its per-step parameter now.

        ``step()`` does this itself, and so does reading ``param_groups`` (iterating or
        indexing) after a backward (``GradScaler.unscale_`` / ``GradScaler.step``, gradient
        clipping over ``[p for g in opt.param_groups for p in g["params"]]``), so those see,
        unscale and check the tables' gradients like any other. A backward after a merge
        (gradient accumulation with the groups read between micro-batches) adds its
        gradient to ``.grad`` as it is then (clipped, scaled, replaced or set to None), as
        torch does for a dense parameter.
        """
        _set(self, "_preparing", True)
        try:
            self._prepare_grads()
        finally:
            _set(self, "_preparing", False)

    def _prepare_grads(self) -> None:
        self._finish_checks()
        for m in self.tables:
            m._check_retired()
        plans: list[RowPlan | None] = []
        for m in self.tables:
            if not m._has_unmerged_grads():
                # no gradient since the last merge (if any): the merged rows, as they are
                plans.append(m._step_plan())
                continue
            # a first merge, or a backward added gradients after the last one (gradient
            # accumulation with the groups read in between): merge them in
            plans.append(m._take_step_rows(self._sparse))
        self._prepared = plans

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Page in the used rows and their state, run the torch step, write both back.

        A ``closure`` (as torch's optimizers take it) is called first, with grad
        enabled, and its loss is returned."""
        loss = None
        if closure is not None:
            if not callable(closure):
                raise GadgetTypeError(
                    "closure must be a callable that re-evaluates the model and returns the "
                    f"loss, or None; got {type(closure).__name__} {closure!r:.40}"
                )
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads()
        plans, self._prepared = self._prepared or [], None
        # the merge is done: torch's step (and anything else here) reading the groups must
        # not merge again (that would rebuild gradients the user clipped or unscaled)
        _set(self, "_preparing", True)
        try:
            self._step_tables(plans)
        finally:
            _set(self, "_preparing", False)
        return loss

    def _step_tables(self, plans: list[RowPlan | None]) -> None:
        # a closed table (or state table) is refused before any table is paged or written:
        # a step is applied to every table or to none
        for m, pager, plan in zip(self.tables, self.pagers, plans, strict=True):
            if plan is not None:
                m.table.store.check_open()
                for t in pager.tables.values():
                    t.store.check_open()
        for m, pager, plan in zip(self.tables, self.pagers, plans, strict=True):
            if plan is not None:
                pre = m._prefetched
                # states a forward gathered are used unless the tables were refilled since
                fresh = pre[0] if pre is not None and pre[1] == pager.generation else None
                pager.load(plan, prefetched=fresh)
            if pager.layout_version != m._state_version:
                # state tables were added (a scheduler turned an option on, or a loaded
                # state held more): the next forwards gather them with the rows too
                _set(m, "_state_version", pager.layout_version)
                if pager.interleaved:
                    _set(m, "_state_stores", [t.store for t in pager.tables.values()])
                    _set(m, "_fused", None)
                    _set(m, "_graphs", None)
            _set(m, "_prefetched", None)
        self.inner.step()
        for m, pager, plan in zip(self.tables, self.pagers, plans, strict=True):
            if plan is not None:
                # the rows and their state go back together: one fused scatter
                pager.store_back(plan, with_table=(m.table.store, m._slot.param.detach()))
                m._slot.param.grad = None
            m._end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients of the ordinary parameters and of this step's table rows.

        Raises :class:`~gadgetloader.GadgetIndexError` for a CUDA id out of range in a
        training lookup since the last step (see :class:`OffloadedEmbedding`)."""
        _set(self, "_preparing", True)  # walking the groups here must not merge grads
        try:
            self.inner.zero_grad(set_to_none=set_to_none)
        finally:
            _set(self, "_preparing", False)
        self._prepared = None
        for m in self.tables:
            m._clear_grads()
            m._slot.param.grad = None
        self._finish_checks()

    def _finish_checks(self) -> None:
        """Finish every table's pending range checks; on a bad id forget this step's
        lookups (nothing was written) and raise."""
        try:
            for m in self.tables:
                m._finish_checks()
        except Exception:
            for m in self.tables:
                m._drop_step()
            self._prepared = None
            raise

    # ---- state_dict: everything, tables included (small tables) ----------------------
    def _inner_state_without_rows(self) -> dict[str, Any]:
        """The inner optimizer's state_dict with the per-step rows dropped and every
        remaining tensor copied (torch's own state_dict aliases live state)."""
        _set(self, "_preparing", True)  # saving state must not merge this step's grads
        try:
            return self._inner_state_quiet()
        finally:
            _set(self, "_preparing", False)

    def _inner_state_quiet(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        row_keys = {
            id(m._slot.param): pager.row_keys
            for m, pager in zip(self.tables, self.pagers, strict=True)
        }
        flat = [p for group in list.__iter__(self.inner.param_groups) for p in group["params"]]
        state: dict[Any, Any] = {}
        for index, entry in sd["state"].items():
            drop = (
                row_keys.get(id(flat[index]), ())
                if isinstance(index, int) and index < len(flat)
                else ()
            )
            state[index] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in entry.items()
                if k not in drop
            }
        return {"state": state, "param_groups": sd["param_groups"]}

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (scalars such as ``step`` included) plus every
        offloaded table's full state tables as CPU tensors (for small tables; see
        :func:`~gadgetloader.switching.save_checkpoint` for large ones).

        Hooks registered on this optimizer with ``register_state_dict_pre_hook`` /
        ``register_state_dict_post_hook`` run as torch runs them (a post hook may return
        a new dict)."""
        for pre_hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            pre_hook(self)
        state_dict = self._state_dict()
        for post_hook in list(getattr(self, "_optimizer_state_dict_post_hooks", {}).values()):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _state_dict(self) -> dict[str, Any]:
        for pager in self.pagers:
            pager.follow_hyper()
        return {
            "inner": self._inner_state_without_rows(),
            "tables": [
                {k: table_tensor(t) for k, t in pager.tables.items()} for pager in self.pagers
            ],
            **optimizer_tags(self.inner),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same model structure and optimizer
        class; anything else is refused before any state changes).

        Hooks registered with ``register_load_state_dict_pre_hook`` (which may return a
        new dict, e.g. without an entry a state-dict post hook added) and
        ``register_load_state_dict_post_hook`` run as torch runs them."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # (as torch: a pre hook may edit its copy)
        for pre_hook in list(getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in list(getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values()):
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise GadgetTypeError(
                f"expected an OffloadedOptimizer state_dict (a dict) for {len(self.pagers)} "
                f"offloaded tables; got {type(state_dict).__name__}"
            )
        if (
            not {"inner", "tables"}
            <= set(state_dict)
            <= {
                "inner",
                "tables",
                "optimizer",
                "optimizer_base",
            }
            or not isinstance(state_dict["tables"], (list, tuple))
            or len(state_dict["tables"]) != len(self.pagers)
        ):
            keys = sorted(state_dict, key=str)
            tables = state_dict.get("tables")
            raise GadgetValueError(
                f"expected an OffloadedOptimizer state_dict for {len(self.pagers)} offloaded tables "
                f"(keys 'inner' and 'tables', a list of one dict per table); got keys {keys}"
                + (
                    f" and 'tables' a {type(tables).__name__}"
                    if not isinstance(tables, (list, tuple))
                    else f" and {len(tables)} tables"
                )
            )
        check_optimizer_kind(state_dict, self.inner, "the state dict")
        if state_dict.get("optimizer") is None:
            self._check_untagged(state_dict.get("inner"), "the state dict")
        self.check_inner_state(state_dict["inner"], "the state dict")
        self._probe_saved_groups(state_dict["inner"], "the state dict")
        # check everything before writing anything: a bad state dict changes nothing
        for pager in self.pagers:
            pager.follow_hyper()  # state a scheduler turned on since construction has its table
        writes = []
        resets = []
        for pager, tables in zip(self.pagers, state_dict["tables"], strict=True):
            # the state dict may hold more state than this optimizer has turned on yet (a
            # scheduler's momentum): torch keeps such state, so it gets its table; it may
            # lack state its saved options do not keep (saved before momentum came on):
            # torch's load drops such state, and its table starts afresh
            saved_groups = (state_dict.get("inner") or {}).get("param_groups")
            if (
                not isinstance(tables, dict)
                or not set(pager.tables) - set(tables) <= pager.missing_keys_allowed(saved_groups)
                or not set(tables) - set(pager.tables) <= pager.extra_keys_allowed(saved_groups)
            ):
                got = sorted(tables, key=str) if isinstance(tables, dict) else type(tables).__name__
                raise GadgetValueError(
                    f"state tables {got} do not match this optimizer's {sorted(pager.tables)} "
                    "(plus what its saved hyper-parameters would turn on)"
                )
            first = next(iter(pager.tables.values()), None)
            for key, t in tables.items():
                table = pager.tables.get(key)
                if not isinstance(t, torch.Tensor):
                    raise GadgetTypeError(
                        f"state table {key!r}: expected a tensor, got {type(t).__name__}"
                    )
                shape = table.shape if table is not None else pager.table_shape()
                if tuple(t.shape) != shape:
                    raise GadgetValueError(
                        f"state table {key!r}: expected shape {shape}, got {tuple(t.shape)}"
                    )
                if t.layout != torch.strided or t.device.type == "meta":
                    raise GadgetTypeError(
                        f"state table {key!r}: expected a dense tensor with values, got a "
                        f"{t.layout} tensor on {t.device}"
                    )
                if not (t.is_floating_point() or (table is not None and t.dtype == table.dtype)):
                    raise GadgetTypeError(
                        f"state table {key!r}: expected a floating-point tensor, got {t.dtype}"
                    )
                if table is not None:
                    table.store.check_open()  # a closed state table: nothing is loaded
                writes.append((pager, key, t, first))
            missing = set(pager.tables) - set(tables)
            for key in missing:
                pager.tables[key].store.check_open()  # a closed table to reset: nothing loads
            resets.append((pager, missing))
        self._load_inner(state_dict["inner"])
        for pager, keys in resets:
            pager.reset_row_keys(keys)
        for pager, key, t, first in writes:
            table = pager.tables.get(key)
            if table is None:
                table = pager.add_row_key(
                    key, first.dtype if first is not None else pager.param.dtype
                )
            table.store.write_block(0, t.to(table.dtype))
            table.store.synchronize()
        for pager in self.pagers:
            pager.mark_loaded()

    def _probe_saved_groups(self, sd: dict[str, Any], what: str) -> None:
        """Refuse saved group options the constructor would refuse for an offloaded table
        (``differentiable=True``, options with which a step fails): each table's saved
        group is probed as its group was when the optimizer was made."""
        own = list(list.__iter__(self.inner.param_groups))
        saved = _filled_groups(self.inner, list(sd["param_groups"]))
        for m, pager in zip(self.tables, self.pagers, strict=True):
            n = next(k for k, g in enumerate(own) if any(p is m._slot.param for p in g["params"]))
            hyper = {k: v for k, v in dict(saved[n]).items() if k != "params"}
            try:
                probe_state(self.inner, m._slot.param, hyper=hyper, dtype=pager._param_dtype)
            except GadgetError as exc:
                raise type(exc)(f"{what}: saved parameter group {n}: {exc}") from exc

    def check_inner_state(self, sd: Any, what: str) -> None:
        """Refuse a saved inner (torch) optimizer state ``sd`` (a torch optimizer's
        ``state_dict()``) that does not fit the inner optimizer, with an error that names it
        as ``what`` (e.g. ``'the state dict'``): see
        :func:`check_optimizer_state`; the dense parameters' state must have their shapes.
        Used by :meth:`load_state_dict` and checkpoints before anything changes."""
        check_optimizer_state(
            self.inner,
            sd,
            what,
            shapes=True,
            skip=frozenset(id(m._slot.param) for m in self.tables),
        )
        for n, pager, entry in self._saved_table_entries(sd):
            # every table holds its scalar state from construction on (a never-stepped
            # one: ``step`` 0), so a saved table without it was edited or damaged: its
            # state rows would load while its step count restarted
            keeps = set(pager.layout.init_scalars)
            missing = keeps - (set(entry) if isinstance(entry, dict) else set())
            if missing:
                raise GadgetValueError(
                    f"{what}: offloaded table {n}'s saved optimizer state lacks "
                    f"{sorted(missing)}, which this {optimizer_kind(self.inner)} keeps for "
                    f"every table (got {sorted(entry, key=str) if isinstance(entry, dict) else entry!r}); "
                    "its state rows would load with the step count restarted"
                )

    def _saved_table_entries(self, sd: Any) -> list[tuple[int, Any, Any]]:
        """``(n, pager, entry)`` for each offloaded table that the saved inner state ``sd``
        has a parameter for: ``entry`` is its saved state (None when there is none)."""
        if not isinstance(sd, dict) or not isinstance(sd.get("state") or {}, dict):
            return []
        states = sd.get("state") or {}
        saved_ids = [
            i
            for g in sd.get("param_groups") or []
            if isinstance(g, dict)
            for i in g.get("params", [])
        ]
        mine = [p for g in list.__iter__(self.inner.param_groups) for p in g["params"]]
        where = {id(p): k for k, p in enumerate(mine)}
        out = []
        for n, (m, pager) in enumerate(zip(self.tables, self.pagers, strict=True)):
            k = where.get(id(m._slot.param))
            if k is None or k >= len(saved_ids):
                continue
            out.append((n, pager, states.get(saved_ids[k])))
        return out

    def _check_untagged(self, sd: Any, what: str) -> None:
        """State saved without the optimizer's class (before it was recorded): each table's
        saved scalar state must be what this optimizer keeps (Adam's ``step`` alone would
        fail part-way inside NAdam's load, which needs ``mu_product``)."""
        for n, pager, entry in self._saved_table_entries(sd):
            if not isinstance(entry, dict) or not entry:
                continue  # saved before its first step
            saved = set(entry) - set(pager.row_keys)
            keeps = set(pager.layout.init_scalars)
            if saved != keeps:
                raise GadgetValueError(
                    f"{what}: offloaded table {n}'s saved optimizer state has {sorted(saved)}; "
                    f"this {optimizer_kind(self.inner)} keeps {sorted(keeps)} (state of "
                    "another optimizer class?)"
                )

    def _load_inner(self, sd: dict[str, Any]) -> None:
        before = self.inner.state_dict()
        try:
            self.inner.load_state_dict(sd)
        except Exception as exc:
            # torch's load failed part-way (state of another kind): put back what was there
            self.inner.load_state_dict(before)
            self._share_groups()
            self.state = self.inner.state
            raise GadgetValueError(
                f"the saved optimizer state does not fit this {optimizer_kind(self.inner)} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        keep_saved_scalar_dtypes(self.inner, sd)
        # load_state_dict rebuilt inner.state and the groups; share them again
        self._share_groups()
        self.state = self.inner.state

    def _share_groups(self) -> None:
        """Share the inner optimizer's param groups, as a list that merges pending table
        gradients (:meth:`prepare_grads`) before anything walks it after a backward."""
        groups = _Groups(self.inner.param_groups)
        groups._owner = weakref.ref(self)
        self.inner.param_groups = groups
        self.param_groups = groups

    def _auto_prepare(self) -> None:
        if self._preparing:
            return
        for m in self.tables:
            if m._pending and m._has_unmerged_grads():
                self.prepare_grads()
                return
