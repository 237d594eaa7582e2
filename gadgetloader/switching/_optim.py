"""Optimizer-state paging: the per-row state of one parameter lives in tables.

A torch optimizer keeps, per parameter, some tensors of the parameter's shape
(Adam's ``exp_avg`` and ``exp_avg_sq``, Adagrad's ``sum``, Rprop's ``prev`` and
``step_size``, ...) and some scalars (``step``, ASGD's ``eta`` and ``mu``). When
the parameter is a small per-step variable holding only a batch's rows, the
row-shaped state must follow those rows: gathered from full tables before the
optimizer step and scattered back after it. The scalars stay in the optimizer,
exactly as torch keeps them (one step count per table, as torch's SparseAdam).

Nothing here is written per optimizer class. :func:`probe_state` runs a fresh
instance of the user's optimizer class, with the same hyper-parameters, on a
one-row probe parameter and records every state entry at the moment torch
creates it: row-shaped entries are paged, 0-d and Python scalars stay in place,
and the recorded values are the rows a never-trained row starts from (so Rprop's
``step_size`` starts at ``lr`` with no warm-up step).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._device import cuda_available
from .._errors import GadgetKeyError, GadgetTypeError, GadgetValueError, as_count
from .._paths import as_path
from ..gadget import DataGadget
from ..stores import Store
from ..stores._base import FusedRows
from ..stores._base import gather_many as gather_stores
from ..stores._base import scatter_many as scatter_stores
from ._rows import PlanCache, exact_plan, rows_preview, same_rows
from ._torchfile import check_tensor, load_torch_file, save_torch_file, table_tensor

if TYPE_CHECKING:
    from ._rows import RowPlan

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "OptimizerSwitch",
    "StateLayout",
    "StatePager",
    "interleave_ok",
    "probe_state",
    "resolve_named_parameter",
    "supported_name",
]

#: torch optimizers whose state is elementwise (row-shaped tensors plus scalars)
SUPPORTED_OPTIMIZERS: tuple[str, ...] = (
    "SparseAdam",
    "Adam",
    "AdamW",
    "Adamax",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "ASGD",
    "Adagrad",
    "SGD",
    "NAdam",
    "RAdam",
)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """What a saved optimizer state is tagged with: its class, as ``module.Name``."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _torch_base(optimizer: torch.optim.Optimizer) -> str | None:
    """The torch optimizer class ``optimizer`` is or derives from (its name)."""
    for base in type(optimizer).__mro__:
        if base.__module__.startswith("torch.optim") and base is not torch.optim.Optimizer:
            return base.__qualname__
    return None


def optimizer_tags(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The entries a saved optimizer state carries about its optimizer: the class and the
    torch optimizer it is (or derives from)."""
    return {"optimizer": optimizer_kind(optimizer), "optimizer_base": _torch_base(optimizer)}


def check_optimizer_kind(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, what: str
) -> None:
    """Refuse optimizer state saved by another optimizer class (``saved``: a state dict or
    checkpoint entry with :func:`optimizer_tags`; one saved without them is let through).

    The same class name in another module is taken when it is the same torch optimizer
    underneath (a class defined in a training script, ``__main__.MyAdam``, resumes from the
    module it was moved to)."""
    tag = saved.get("optimizer")
    if tag is None:
        return
    mine = optimizer_kind(optimizer)
    if tag == mine:
        return
    same_name = str(tag).endswith("." + type(optimizer).__qualname__)
    # (state saved before the torch base was recorded: the class name alone)
    if same_name and saved.get("optimizer_base", _torch_base(optimizer)) == _torch_base(optimizer):
        return
    raise GadgetValueError(
        f"{what} holds the state of a {tag} optimizer; this optimizer is a {mine} "
        "(build the optimizer that saved it to load it)"
    )


#: state a factored optimizer (Adafactor) keeps per parameter in a reduced shape
_FACTORED_STATE = frozenset({"row_var", "col_var"})


def _filled_groups(optimizer: torch.optim.Optimizer, groups: list[Any]) -> list[Any]:
    """``groups`` as the optimizer's ``__setstate__`` completes them on load (options added
    in later torch versions get their defaults); the groups as given where that fails."""
    try:
        probe = object.__new__(type(optimizer))
        filled = [dict(g) for g in groups]
        probe.__setstate__(
            {"defaults": dict(optimizer.defaults), "state": {}, "param_groups": filled}
        )
        return list(probe.param_groups)
    except Exception:  # an optimizer whose __setstate__ needs more: check the groups as given
        return groups


def check_optimizer_state(
    optimizer: torch.optim.Optimizer,
    sd: Any,
    what: str,
    *,
    shapes: bool = False,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Refuse a torch optimizer state dict that ``optimizer.load_state_dict`` would take but
    that would fail later, before anything is loaded: not a dict of ``state`` and
    ``param_groups``, groups of other sizes, a group without an option this optimizer's
    groups have (after the defaults torch fills in on load), an option that is a number
    here and not a number there, state tensors that are sparse or on the meta device, and
    (``shapes=True``) per-parameter state tensors of another shape than their parameter
    (parameters whose ``id`` is in ``skip`` excepted: offloaded tables keep their rows'
    state in tables)."""
    if (
        not isinstance(sd, Mapping)
        or not isinstance(sd.get("state"), Mapping)
        or not isinstance(sd.get("param_groups"), (list, tuple))
        or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
            for g in sd["param_groups"]
        )
    ):
        raise GadgetTypeError(
            f"{what}: expected a torch optimizer state (a dict with 'state' and a list of "
            f"'param_groups', each with its 'params'); got {type(sd).__name__}"
            + (f" with keys {sorted(map(str, sd))}" if isinstance(sd, Mapping) else "")
        )
    groups = list(sd["param_groups"])
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in groups]
    if mine != theirs:
        raise GadgetValueError(
            f"{what}: the saved optimizer has parameter groups of sizes {theirs}; this one's "
            f"are {mine}"
        )
    for n, (own, saved) in enumerate(
        zip(optimizer.param_groups, _filled_groups(optimizer, groups), strict=True)
    ):
        missing = sorted(k for k in own if k != "params" and k not in saved)
        if missing:
            raise GadgetValueError(
                f"{what}: the saved optimizer state does not fit this "
                f"{optimizer_kind(optimizer)}: saved parameter group {n} lacks the option(s) "
                f"{missing} its groups have (state of another optimizer class?)"
            )
        for k, v in own.items():
            new = saved.get(k)
            if isinstance(v, bool) and not isinstance(new, (bool, np.bool_)):
                raise GadgetTypeError(
                    f"{what}: option {k!r} of saved parameter group {n} is {new!r}; expected "
                    "True or False"
                )
            if isinstance(v, tuple) and not (isinstance(new, (tuple, list)) and len(new) == len(v)):
                raise GadgetTypeError(
                    f"{what}: option {k!r} of saved parameter group {n} is {new!r}; expected "
                    f"{len(v)} values, as {v!r}"
                )
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if number and not (
                (
                    isinstance(new, (int, float, np.integer, np.floating))
                    and not isinstance(new, bool)
                )
                or (isinstance(new, torch.Tensor) and new.numel() == 1)
            ):
                raise GadgetTypeError(
                    f"{what}: option {k!r} of saved parameter group {n} is {new!r}; expected "
                    "a number"
                )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in groups for i in g["params"]]
    where = dict(zip(saved_ids, params, strict=True))
    # a saved group that turns amsgrad on for a dense parameter whose saved state was made
    # with it off: torch's Adam would fail at the next step (no max_exp_avg_sq), after the
    # offloaded tables had grown the new state table; refused here, before any change
    amsgrad = {
        i
        for g in _filled_groups(optimizer, groups)
        if g.get("amsgrad") is True or isinstance(g.get("amsgrad"), np.bool_) and g["amsgrad"]
        for i in g["params"]
    }
    for pid, entry in sd["state"].items():
        if not isinstance(entry, Mapping):
            continue
        p = where.get(pid)
        if (
            shapes
            and pid in amsgrad
            and p is not None
            and id(p) not in skip
            and "exp_avg_sq" in entry
            and "max_exp_avg_sq" not in entry
        ):
            raise GadgetValueError(
                f"{what}: its parameter group turns amsgrad on, but the saved state of "
                f"parameter {pid!r} has no 'max_exp_avg_sq' (it was saved with amsgrad off); "
                "torch's Adam would fail at its next step. Load it with amsgrad off, or "
                "save it from an optimizer with amsgrad on"
            )
        for k, v in entry.items():
            if not isinstance(v, torch.Tensor):
                continue
            if v.layout != torch.strided or v.device.type == "meta":
                raise GadgetTypeError(
                    f"{what}: state {k!r} of parameter {pid!r} is a {v.layout} tensor on "
                    f"{v.device}; expected a dense tensor with values"
                )
            if (
                shapes
                and p is not None
                and id(p) not in skip
                and v.dim() > 0
                and k not in _FACTORED_STATE
                and tuple(v.shape) != tuple(p.shape)
            ):
                raise GadgetValueError(
                    f"{what}: state {k!r} of parameter {pid!r} has shape {tuple(v.shape)}; "
                    f"that parameter's shape here is {tuple(p.shape)} (state of another model?)"
                )


def supported_name(optimizer: Any) -> str:
    """The supported torch optimizer class ``optimizer`` is (or derives from).

    Raises
    ------
    GadgetTypeError
        For any other optimizer; the message lists the supported ones.
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base in cls.__mro__:
        if (
            base.__name__ in SUPPORTED_OPTIMIZERS
            and getattr(torch.optim, base.__name__, None) is base
        ):
            return base.__name__
    raise GadgetTypeError(
        f"cannot page the state of optimizer class {cls.__name__}; expected one of torch.optim."
        f"{{{', '.join(SUPPORTED_OPTIMIZERS)}}} (or a subclass): their state is elementwise, "
        "so rows of it can live in a table"
    )


class StateLayout(NamedTuple):
    """What an optimizer keeps for one parameter.

    Attributes
    ----------
    row_keys : tuple of str
        State entries with the parameter's shape (paged by rows).
    init_rows : dict
        For each row key, the 1-row value torch gives a fresh parameter.
    init_scalars : dict
        Scalar entries (0-d tensors or numbers) as torch creates them.
    sparse_grad : bool
        Whether the optimizer wants sparse gradients (SparseAdam).
    """

    row_keys: tuple[str, ...]
    init_rows: dict[str, torch.Tensor]
    init_scalars: dict[str, Any]
    sparse_grad: bool


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class _RecordingDict(dict):  # type: ignore[type-arg]
    """A per-parameter state dict that remembers each entry's value when first set."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[Any, Any] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self.first:
            self.first[key] = _snapshot(value)
        super().__setitem__(key, value)


def _quiet_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups, read without side effects (an
    :class:`~gadgetloader.OffloadedOptimizer`'s groups merge pending table gradients when
    user code reads them; this module's own reads must not)."""
    groups = optimizer.param_groups
    return list(list.__iter__(groups)) if isinstance(groups, list) else list(groups)


def _group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    for group in _quiet_groups(optimizer):
        if any(p is param for p in group["params"]):
            return group
    raise GadgetKeyError(
        "the model variable is not among the optimizer's parameters; create the optimizer "
        "over the model's parameters (e.g. torch.optim.Adam(model.parameters()))"
    )


def probe_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    hyper: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> StateLayout:
    """Find the per-row and scalar state ``optimizer`` keeps for ``param``.

    Notes
    -----
    Runs one step of a fresh optimizer of the same class and hyper-parameters on a
    one-row zero parameter with a zero gradient, on ``param``'s device and dtype (or
    ``dtype``: the one the parameter has while it is paged), and records state entries
    as torch creates them. The user's optimizer is not touched. A class from outside
    ``torch.optim`` is probed a second time with other parameter values: a row state
    that starts from them (``state['avg'] = p.clone()``) cannot be made for a row
    before it is read, and is refused with :class:`~gadgetloader.GadgetTypeError`.
    """
    name = supported_name(optimizer)
    cls = type(optimizer)
    if hyper is None:
        group = _group_of(optimizer, param)
        hyper = {k: v for k, v in group.items() if k != "params"}
    if param.dim() < 1:
        raise GadgetValueError(
            f"a paged parameter needs a row axis; got shape {tuple(param.shape)}"
        )
    if hyper.get("differentiable"):
        raise GadgetTypeError(
            f"{cls.__name__}(differentiable=True) cannot be paged: paged rows are updated in "
            "place outside autograd; leave differentiable at False"
        )
    own = inspect.signature(cls.__init__).parameters
    accepted = _init_options(cls)
    kwargs = {k: v for k, v in hyper.items() if k in accepted}
    defaults = getattr(optimizer, "defaults", {})
    if "initial_accumulator_value" in kwargs and "initial_accumulator_value" in defaults:
        # torch's Adagrad fills every group's `sum` from its constructor's value and
        # ignores a group's own
        kwargs["initial_accumulator_value"] = defaults["initial_accumulator_value"]
    sparse = name == "SparseAdam"
    shape = (1, *param.shape[1:])
    pdtype = dtype if dtype is not None else param.dtype
    probe = torch.zeros(shape, dtype=pdtype, device=param.device, requires_grad=True)
    state, first = _probe_step(cls, probe, kwargs, own, hyper, sparse)
    if not cls.__module__.startswith("torch.optim"):
        # a class of the user's own may start a state from the parameter's values (an
        # average of the weights, say): a second probe with other values shows it
        n = math.prod(shape)
        values = torch.linspace(0.5, 1.5, n, dtype=torch.float64).to(pdtype).to(param.device)
        other = values.view(shape).clone().requires_grad_(True)
        _, first_other = _probe_step(cls, other, kwargs, own, hyper, sparse)
        for key, value in first.items():
            if not (isinstance(value, torch.Tensor) and tuple(value.shape) == shape):
                continue
            b = first_other.get(key)
            if key == "momentum_buffer" and issubclass(cls, torch.optim.SGD):
                # SGD's buffer starts as the first step's gradient, weight decay included
                # (a zero buffer reproduces that): here the decay's share of the parameter
                decay = float(hyper.get("weight_decay", 0) or 0)
                start = values.view(shape)  # (the probe's values before its step)
                value = torch.zeros_like(start).add_(start, alpha=decay)
            if isinstance(b, torch.Tensor) and not torch.equal(value, b):
                raise GadgetTypeError(
                    f"{cls.__name__} starts its state {key!r} from the parameter's values, "
                    "which cannot be paged (a row's state is made before its values are "
                    "read); start it from a constant, as torch's optimizers do, or train "
                    f"with one of {', '.join(SUPPORTED_OPTIMIZERS)}"
                )
    row_keys: list[str] = []
    init_rows: dict[str, torch.Tensor] = {}
    init_scalars: dict[str, Any] = {}
    for key, value in state.items():
        first_value = first.get(key, value)
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(probe.shape):
            row_keys.append(key)
            init_rows[key] = (
                first_value.detach().clone()
                if isinstance(first_value, torch.Tensor)
                else torch.zeros_like(value)
            )
        elif not isinstance(value, torch.Tensor) or value.dim() == 0:
            init_scalars[key] = _snapshot(first_value)
        else:
            raise GadgetTypeError(
                f"{cls.__name__} keeps state {key!r} of shape {tuple(value.shape)} for a parameter "
                f"of shape {tuple(probe.shape)}; only row-shaped and scalar state can be paged "
                f"(supported: {', '.join(SUPPORTED_OPTIMIZERS)})"
            )
    return StateLayout(tuple(row_keys), init_rows, init_scalars, sparse)


def _probe_step(
    cls: type,
    probe: torch.Tensor,
    kwargs: dict[str, Any],
    own: Mapping[str, Any],
    hyper: dict[str, Any],
    sparse: bool,
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """One step of a fresh ``cls`` on the one-row ``probe`` with a zero gradient: its
    state after the step, and each entry's value when it was first set."""
    try:
        probe_opt = _build_probe(cls, probe, kwargs, own)
    except Exception as exc:
        # a value the optimizer refuses (lr=-1) is a value error, as the constructor's is
        kind = GadgetValueError if isinstance(exc, ValueError) else GadgetTypeError
        name = cls.__name__
        article = "an" if name[:1].lower() in "aeiou" else "a"
        raise kind(
            f"could not build {article} {name} like the given one to find its state ({exc})"
        ) from exc
    # the step reads the group: give it the user's values (a subclass may have rewritten
    # its arguments, or passed them on through **kwargs)
    probe_opt.param_groups[0].update(hyper)
    before = {k: _snapshot(v) for k, v in probe_opt.state.get(probe, {}).items()}
    recording: defaultdict[Any, Any] = defaultdict(_RecordingDict)
    rec = recording[probe]
    for k, v in probe_opt.state.get(probe, {}).items():
        rec[k] = v
    rec.first.update(before)
    probe_opt.state = recording
    zero = torch.zeros_like(probe).detach()
    if sparse:
        idx = torch.zeros((1, 1), dtype=torch.int64, device=probe.device)
        probe.grad = torch.sparse_coo_tensor(idx, zero, probe.shape, check_invariants=False)
    else:
        probe.grad = zero
    try:
        with _no_global_step_hooks():
            probe_opt.step()
    except Exception as exc:
        raise GadgetTypeError(
            f"{cls.__name__} with these options failed a step on a one-row probe of the "
            f"table, so its state cannot be paged ({type(exc).__name__}: {exc})"
        ) from exc
    state = dict(probe_opt.state[probe])
    return state, {k: rec.first.get(k, v) for k, v in state.items()}


@contextlib.contextmanager
def _no_global_step_hooks() -> Iterator[None]:
    """torch's global optimizer step hooks (``register_optimizer_step_pre_hook`` /
    ``..._post_hook``) left out for a probe's step: that step is no step of the user's
    (the same hook objects, in the same order, are back afterwards)."""
    from torch.optim import optimizer as torch_optimizer

    saved = []
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        hooks = getattr(torch_optimizer, name, None)
        if isinstance(hooks, dict):
            saved.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def _build_probe(
    cls: type, probe: torch.Tensor, kwargs: dict[str, Any], own: Mapping[str, Any]
) -> Any:
    """``cls([probe], **kwargs)``. A subclass that sets some options itself and passes the
    rest on as ``**kwargs`` refuses those it sets ("got multiple values for keyword
    argument"): they are dropped one by one (the probe's group gets every option after),
    and where the refusal names none, only the subclass's own parameters are passed."""
    kwargs = dict(kwargs)
    while True:
        try:
            return cls([probe], **kwargs)
        except TypeError as exc:
            m = re.search(r"multiple values for (?:keyword )?argument '(\w+)'", str(exc))
            if m and m.group(1) in kwargs:
                del kwargs[m.group(1)]
                continue
            narrow = {k: v for k, v in kwargs.items() if k in own}
            if set(narrow) == set(kwargs):
                raise
            kwargs = narrow


def _init_options(cls: type) -> set[str]:
    """The keyword options ``cls(params, ...)`` takes: its ``__init__``'s, and where that
    passes ``**kwargs`` on, those of the classes above it (a subclass that forwards them
    to :class:`torch.optim.Adam` takes Adam's)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(
            k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


def _hyper_key(group: dict[str, Any], exact: bool) -> tuple[Any, ...]:
    """A comparable summary of a param group's hyper-parameters: their values (``exact``)
    or only whether each option is on (a number other than 0, a true flag)."""

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else (v.data_ptr(), tuple(v.shape))
        if isinstance(v, np.generic):  # a NumPy number or bool: its Python value
            v = v.item()
        if isinstance(v, (tuple, list)):
            return tuple(one(x) for x in v)
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return v if exact else v != 0
        return type(v).__name__

    return tuple((k, one(v)) for k, v in group.items() if k != "params")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and _same_tensor(a.detach().cpu(), b.detach().cpu())
        )
    return bool(a == b)


def _fill_state(table: DataGadget, init: torch.Tensor, row_shape: tuple[int, ...]) -> None:
    """Fill every row of ``table`` with the one-row state ``init``."""
    fill = init.reshape(row_shape)
    if torch.all(fill == fill.reshape(-1)[0]).item():
        table.fill_(float(fill.reshape(-1)[0].item()) if fill.numel() else 0.0)
    else:
        table.init_(lambda t, f=fill: t.copy_(f.to(t.device, t.dtype).expand_as(t)))


#: the pagers of the optimizer switchers of each paged parameter (whenever either switcher
#: was built): a model switcher's step is under way until theirs are written back too
_PAGERS: Any = WeakIdKeyDictionary()  # (tensors as keys: by identity)


def pagers_for(param: Any) -> list[Any]:
    """The live pagers of optimizer switchers of ``param``."""
    return list(_PAGERS.get(param, ()))


class StatePager:
    """Pages the row-shaped optimizer state of one parameter between tables and the optimizer.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Holds ``param``; its scalar state for ``param`` stays where torch keeps it.
    param : torch.Tensor
        The per-step variable (a batch's rows of one table).
    num_rows : int
        Rows of the full table.
    placement : str
        Where the state tables live (``'pinned'``, ``'cuda'``, ``'cpu'``).
    dtype : torch.dtype, optional
        Dtype of the state tables (default: what torch uses for the state).
    table : DataGadget, optional
        The parameter's full table. Where it lives in host RAM (``pinned`` or ``cpu``)
        with the states' placement and dtype, it is moved into one buffer with the
        state tables, row ``i`` of each side by side (:func:`interleave_ok`): a step's
        rows then cost one host-page translation for the table and all its states
        instead of one each (DESIGN.md). This copies the table once; the
        :class:`~gadgetloader.DataGadget` object stays the same, views taken from it
        before (``as_tensor()``) no longer see it.
    interleave : bool, default True
        ``False`` keeps the state tables separate from ``table``.

    Notes
    -----
    Each step moves, per row-shaped state entry, the batch's distinct rows in
    (one gather) and out (one scatter): Adam over a float32 table moves 3x the
    rows' bytes each way (weights plus two moments).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        param: torch.Tensor,
        num_rows: int,
        *,
        placement: str,
        dtype: torch.dtype | None = None,
        table: DataGadget | None = None,
        interleave: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.param = param
        #: the dtype the parameter has while a model switcher pages it (its table's dtype):
        #: the optimizer's state rows must match it, whatever dtype the state tables keep
        self._param_dtype = table.dtype if table is not None else None
        self.layout = probe_state(optimizer, param, dtype=self._param_dtype)
        row_shape = tuple(param.shape[1:])
        #: the parameter's group, and its hyper-parameters when the layout was probed: the
        #: exact values until the first step (a scheduler may change ``lr`` before it, and
        #: Rprop's ``step_size`` / ASGD's ``eta`` start from the first step's ``lr``), then
        #: only which options are on (momentum 0 -> 0.9 adds a momentum buffer)
        self._group = _group_of(optimizer, param)
        self._hyper = _hyper_key(self._group, exact=True)
        self._hyper_on = _hyper_key(self._group, exact=False)
        #: the group's values as last seen (compared by identity: a cheap first test)
        self._raw: tuple[Any, ...] = tuple(self._group.values())
        #: True until the state is first written back or loaded: the tables still hold a
        #: fresh row's state and may be refilled from the first step's hyper-parameters
        self.fresh = True
        #: bumped when state tables are added (the layout grew)
        self.layout_version = 0
        self._placement = placement
        self._dtype = dtype
        self._num_rows = num_rows
        self.tables: dict[str, DataGadget] = {}
        #: whether a fresh row's state is all zeros (padding rows are then zeroed)
        self._zero_init: dict[str, bool] = {}
        dtypes = [
            dtype if dtype is not None else self.layout.init_rows[k].dtype
            for k in self.layout.row_keys
        ]
        slots = (
            _interleave_with(table, placement, num_rows, row_shape, dtypes, param.device)
            if interleave and table is not None
            else None
        )
        #: whether the state tables share their rows with the parameter's table
        self.interleaved = slots is not None
        #: the plan whose rows the optimizer state holds, and the plan last written back
        self.loaded_plan: RowPlan | None = None
        self.stored_plan: RowPlan | None = None
        #: bumped at every write-back: state rows gathered before it are stale
        self.generation = 0
        #: (device, prepared fused transfer) of the last write-back's stores
        self._fused: tuple[torch.device, FusedRows] | None = None
        for i, key in enumerate(self.layout.row_keys):
            init = self.layout.init_rows[key]
            self._zero_init[key] = bool((init == 0).all().item()) if init.numel() else True
            if slots is not None:
                state_table = DataGadget._of_store(slots[i], device=param.device)
            else:
                state_table = DataGadget(
                    shape=(num_rows, *row_shape),
                    dtype=dtypes[i],
                    placement=placement,
                    device=param.device,
                )
            _fill_state(state_table, init, row_shape)
            self.tables[key] = self._guard(state_table)
        state = optimizer.state[param]
        for key, value in self.layout.init_scalars.items():
            if key not in state:
                state[key] = _snapshot(value)
        #: fused SGD with momentum: the other parameters need momentum buffers too
        self._fused_momentum = _fused_sgd_momentum(optimizer)

    @property
    def row_keys(self) -> tuple[str, ...]:
        return self.layout.row_keys

    def follow_hyper(self) -> bool:
        """Follow hyper-parameter changes made since the layout was probed.

        Before the first step any change counts (an LR warm-up lowers ``lr`` before it,
        and torch starts Rprop's ``step_size`` and ASGD's ``eta`` from the first step's
        ``lr``): the layout is probed again and tables whose fresh row changed are
        refilled. After it, only an option turned on or off counts (a scheduler's
        ``momentum`` 0 -> 0.9 makes torch keep a momentum buffer): state that appears
        gets a new table, filled with a fresh row's state (torch's first step for those
        rows). Returns whether the tables changed.
        """
        group = self._current_group()
        raw = tuple(group.values())
        last = self._raw
        if (
            len(raw) == len(last)
            and all(a is b for a, b in zip(raw, last, strict=True))
            and not any(isinstance(v, torch.Tensor) for v in raw)
        ):
            # the very same values as last time (no scheduler, no user change); a tensor
            # value may have changed in place (schedulers fill_ tensor lrs), so not then
            return False
        self._raw = raw
        if self.fresh:
            key = _hyper_key(group, exact=True)
            if key == self._hyper:
                return False
            self._hyper, self._hyper_on = key, _hyper_key(group, exact=False)
        else:
            key = _hyper_key(group, exact=False)
            if key == self._hyper_on:
                return False
            self._hyper_on = key
        return self._adopt(probe_state(self.optimizer, self.param, dtype=self._param_dtype))

    def _current_group(self) -> dict[str, Any]:
        """The parameter's group (found again after ``load_state_dict`` rebuilt the groups)."""
        for group in _quiet_groups(self.optimizer):
            if group is self._group:
                return self._group
        self._group = _group_of(self.optimizer, self.param)
        return self._group

    def _adopt(self, layout: StateLayout) -> bool:
        """Take ``layout`` (a new probe): add tables for new row state; while fresh, refill
        tables and reset scalars whose fresh value changed."""
        old = self.layout
        row_shape = tuple(self.param.shape[1:])
        changed = False
        init_rows = dict(old.init_rows)
        for key in layout.row_keys:
            init = layout.init_rows[key]
            table = self.tables.get(key)
            if table is None:
                table = DataGadget(
                    shape=(self._num_rows, *row_shape),
                    dtype=self._dtype if self._dtype is not None else init.dtype,
                    placement=self._placement,
                    device=self.param.device,
                )
                _fill_state(table, init, row_shape)
                self.tables[key] = self._guard(table)
                changed = True
            elif self.fresh and not _same_tensor(init, old.init_rows[key]):
                _fill_state(table, init, row_shape)
                changed = True
            init_rows[key] = init
            self._zero_init[key] = bool((init == 0).all().item()) if init.numel() else True
        row_keys = old.row_keys + tuple(k for k in layout.row_keys if k not in old.row_keys)
        init_scalars = dict(old.init_scalars)
        state = self.optimizer.state[self.param]
        for key, value in layout.init_scalars.items():
            if key not in state or (self.fresh and not _same_scalar(value, init_scalars.get(key))):
                state[key] = _snapshot(value)
            init_scalars[key] = value
        self.layout = StateLayout(row_keys, init_rows, init_scalars, layout.sparse_grad)
        self._fused_momentum = _fused_sgd_momentum(self.optimizer)
        if changed:
            self._fused = None
            self.layout_version += 1
            self.generation += 1  # state rows gathered before this are stale
        return changed

    def _saved_hyper(self, saved_groups: Any) -> dict[str, Any] | None:
        """This parameter's options in a saved ``param_groups`` list (torch's state-dict
        form: ``params`` as indices), or None where they cannot be found."""
        flat = [p for g in _quiet_groups(self.optimizer) for p in g["params"]]
        index = next((i for i, p in enumerate(flat) if p is self.param), None)
        if index is None or not isinstance(saved_groups, (list, tuple)):
            return None
        for g in saved_groups:
            if isinstance(g, dict) and index in g.get("params", ()):
                return {k: v for k, v in g.items() if k != "params"}
        return None

    def missing_keys_allowed(self, saved_groups: Any) -> set[str]:
        """State tables this parameter has that a saved state may lack: those its saved
        options (``saved_groups``) do not keep, e.g. ``momentum_buffer`` in a state saved
        with momentum 0 before a scheduler turned it on. Torch loads such a state (the
        options load with it) and starts that state afresh if the option comes on again;
        :meth:`reset_row_keys` does the same to the tables."""
        hyper = self._saved_hyper(saved_groups)
        if hyper is None:
            return set()
        try:
            keeps = set(
                probe_state(self.optimizer, self.param, hyper, dtype=self._param_dtype).row_keys
            )
        except Exception:  # noqa: BLE001 - options a step refuses: refused elsewhere
            return set()
        return set(self.tables) - keeps

    def reset_row_keys(self, keys: Any) -> None:
        """Refill the state tables ``keys`` with a fresh row's state (a loaded state did
        not hold them: see :meth:`missing_keys_allowed`)."""
        row_shape = tuple(self.param.shape[1:])
        for key in keys:
            _fill_state(self.tables[key], self.layout.init_rows[key], row_shape)
        self._fused = None
        self.generation += 1

    def extra_keys_allowed(self, saved_groups: Any) -> set[str]:
        """Row-state keys that a saved ``param_groups`` list (torch's state-dict form:
        ``params`` as indices) would make torch keep for this parameter beyond the tables
        it has now, e.g. ``momentum_buffer`` when the saved momentum is on."""
        hyper = self._saved_hyper(saved_groups)
        if hyper is None:
            return set()
        keys: set[str] = set()
        # as saved, and with each option that is off turned on: torch keeps state an
        # option made (a momentum buffer) after the option is turned off again
        trials = [hyper] + [
            {**hyper, k: (True if isinstance(v, bool) else 0.5)}
            for k, v in hyper.items()
            if (isinstance(v, bool) and not v)
            or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)
        ]
        for trial in trials:
            try:
                keys |= set(
                    probe_state(self.optimizer, self.param, trial, dtype=self._param_dtype).row_keys
                )
            except Exception:  # noqa: BLE001 - a combination torch refuses
                continue
        return keys - set(self.tables)

    def table_shape(self) -> tuple[int, ...]:
        """The shape of every state table: ``(rows, *row shape)``."""
        return (self._num_rows, *tuple(self.param.shape[1:]))

    def add_row_key(self, key: str, dtype: torch.dtype) -> DataGadget:
        """A new zero-filled state table for ``key`` (a state dict or checkpoint holds state
        that this optimizer's hyper-parameters have not turned on yet, e.g. a scheduler's
        momentum): torch would keep it, so it is paged from now on."""
        row_shape = tuple(self.param.shape[1:])
        table = DataGadget(
            shape=(self._num_rows, *row_shape),
            dtype=dtype,
            placement=self._placement,
            device=self.param.device,
        )
        table.fill_(0.0)
        self.tables[key] = self._guard(table)
        init = torch.zeros((1, *row_shape), dtype=dtype)
        self.layout = StateLayout(
            self.layout.row_keys + (key,),
            {**self.layout.init_rows, key: init},
            self.layout.init_scalars,
            self.layout.sparse_grad,
        )
        self._zero_init[key] = True
        self._fused = None
        self.layout_version += 1
        self.generation += 1
        return table

    #: set by an optimizer switcher: its state tables refuse to change while a step's
    #: state rows wait for ``afterOptimizerStep`` (which would write them back over it)
    guarded = False
    #: an optimizer switcher's training beforeForwardPass loaded state rows that its
    #: afterOptimizerStep will write back (cleared by the write-back, or when the model
    #: switcher's next lookup replaces that step)
    step_pending = False

    def _guard(self, table: DataGadget) -> DataGadget:
        table.__dict__["_switch"] = weakref.ref(self)  # see DataGadget._check_no_waiting_lookup
        return table

    def _refuse_pending(self, what: str) -> None:
        if self.guarded and self.step_pending:
            raise GadgetValueError(
                f"{what} is refused while a step of its optimizer switcher is under way: "
                "beforeForwardPass loaded state rows that afterOptimizerStep will write back "
                "over the change; change the state before beforeForwardPass or after "
                "afterOptimizerStep"
            )

    def check_unchanged(self) -> None:
        """Raise if a state table was written (a load, an initialiser) after :meth:`load`
        read its rows: those rows must not be written back over the change."""
        read_at = getattr(self, "_read_at", {})
        changed = [
            k
            for k, n in read_at.items()
            if k in self.tables and self.tables[k].__dict__.get("_writes", 0) != n
        ]
        if changed:
            raise GadgetValueError(
                f"afterOptimizerStep: the state tables {changed} were changed (a load, an "
                "initialiser...) after beforeForwardPass read these rows, so they are not "
                "written back over the change (nothing was written); call beforeForwardPass "
                "again for a step on the new state"
            )

    def mark_loaded(self) -> None:
        """After state was loaded: fresh only if it is a never-stepped state (a ``step``
        of 0), whose tables may still be refilled from the first step's hyper-parameters."""
        self.generation += 1  # state rows gathered before the load are stale
        step = self.optimizer.state.get(self.param, {}).get("step")
        try:
            self.fresh = step is not None and float(step) == 0.0
        except (TypeError, ValueError):
            self.fresh = False

    def tables_written(self) -> None:
        """The state tables were written from outside (an initializer, a file): they no
        longer hold a fresh row's state, and rows gathered before are stale."""
        self.fresh = False
        self.generation += 1

    def load(
        self,
        plan: RowPlan,
        capacity: int | None = None,
        prefetched: list[torch.Tensor] | None = None,
    ) -> None:
        """Gather the plan's rows of every state table into the optimizer's state.

        With ``capacity`` (> the plan's rows) the state tensors get that many rows,
        the extra ones holding a fresh row's state (padding of the model variable).
        All state tables move in one fused gather where their placement allows.
        ``prefetched``: the plan's state rows, one tensor of ``capacity`` rows per state
        table, already gathered (with the table's rows, by the model's side) into their
        first ``plan.num_rows`` rows; used in place.
        """
        if self.follow_hyper():
            prefetched = None  # gathered before the tables were refilled or grew
        state = self.optimizer.state[self.param]
        dev = self.param.device
        n = plan.num_rows
        cap = n if capacity is None else max(n, capacity)
        stores = [t.store for t in self.tables.values()]
        self.loaded_plan, self.stored_plan = plan, None
        #: each state table's write count as its rows are read (see check_unchanged)
        self._read_at = {k: t.__dict__.get("_writes", 0) for k, t in self.tables.items()}
        if (
            prefetched is not None
            and len(prefetched) == len(stores)
            and all(
                p.shape[0] == cap and p.device == dev and p.dtype == s.dtype
                for p, s in zip(prefetched, stores, strict=True)
            )
        ):
            full = list(prefetched)
        else:
            full = [torch.empty((cap, *s.row_shape), dtype=s.dtype, device=dev) for s in stores]
            if stores:
                ids = plan.ids.to(stores[0].ids_device(dev))
                gather_stores(
                    stores,
                    ids,
                    dev,
                    outs=[r[:n] for r in full],
                    ids_sorted=plan.distinct,
                    count=plan.n_distinct,
                )
        for (key, store), rows in zip(zip(self.tables, stores, strict=True), full, strict=True):
            init = self.layout.init_rows[key]
            if cap > n:
                if self._zero_init[key]:
                    rows[n:].zero_()
                else:
                    rows[n:].copy_(init.to(dev, store.dtype).expand(cap - n, *store.row_shape))
            want = self._param_dtype or init.dtype
            state[key] = rows if rows.dtype == want else rows.to(want)
        for key, value in self.layout.init_scalars.items():
            if key not in state:
                state[key] = _snapshot(value)
        if self._fused_momentum:
            align_fused_sgd(self.optimizer, self.param)

    def store_back(
        self, plan: RowPlan, with_table: tuple[Store, torch.Tensor] | None = None
    ) -> None:
        """Scatter the optimizer's state rows back to the tables (last occurrence wins).

        ``with_table`` = (the parameter's table store, its rows) writes the parameter's
        rows in the same fused scatter.
        """
        state = self.optimizer.state[self.param]
        stores: list[Store] = []
        rows_out: list[torch.Tensor] = []
        if with_table is not None:
            stores.append(with_table[0])
            rows_out.append(with_table[1][: plan.num_rows])
        self.stored_plan = plan
        self.step_pending = False
        self.generation += 1
        self.fresh = False
        for key, table in self.tables.items():
            rows = state.get(key)
            if rows is None:
                continue
            rows = rows[: plan.num_rows]
            if rows.dtype != table.dtype:
                rows = rows.to(table.dtype)
            stores.append(table.store)
            rows_out.append(rows.detach())
        if not stores:
            return
        where = rows_out[0].device
        if plan.n_distinct is not None and all(r.device == where for r in rows_out):
            fused = self._fused_rows(stores, where)
            if fused is not None:
                fused.scatter(plan.ids, rows_out, plan.n_distinct)
                return
        ids = plan.ids.to(stores[0].ids_device(where))
        if all(r.device == where for r in rows_out) and all(
            s.ids_device(where) == ids.device for s in stores
        ):
            scatter_stores(
                stores,
                ids,
                rows_out,
                unique=plan.distinct,
                count=plan.n_distinct,
                ids_sorted=plan.distinct,  # a distinct plan's ids ascend
            )
        else:
            exact = exact_plan(plan)
            k = exact.num_rows
            for s, r in zip(stores, rows_out, strict=True):
                s.scatter(exact.ids.to(s.ids_device(r.device)), r[:k])

    def _fused_rows(self, stores: list[Store], device: torch.device) -> FusedRows | None:
        """The prepared fused transfer of ``stores`` (rebuilt when they change)."""
        cached = self._fused
        if cached is not None and cached[0] == device and cached[1].matches(stores):
            return cached[1]
        fused = FusedRows.of(stores, device)
        self._fused = None if fused is None else (device, fused)
        return fused

    def scalar_state(self) -> dict[str, Any]:
        """The scalar entries (``step``, ...) torch keeps for the parameter."""
        state = self.optimizer.state.get(self.param, {})
        return {k: _snapshot(state[k]) for k in self.layout.init_scalars if k in state}

    def set_scalar_state(self, values: dict[str, Any]) -> None:
        """Restore scalar entries, keeping torch's types, devices and in-place identity."""
        state = self.optimizer.state[self.param]
        for key, value in values.items():
            cur = state.get(key)
            if isinstance(cur, torch.Tensor) and isinstance(value, torch.Tensor):
                if cur.dtype != value.dtype and value.dim() == 0:
                    # torch's load_state_dict cast it to the parameter's dtype; torch kept
                    # it in another (NAdam's float32 mu_product beside float64 tables)
                    state[key] = value.to(cur.device).clone()
                else:
                    cur.copy_(value.to(cur.device, cur.dtype))
            else:
                state[key] = (
                    _snapshot(value)
                    if not isinstance(cur, torch.Tensor)
                    else torch.as_tensor(value, dtype=cur.dtype, device=cur.device)
                )
        self.mark_loaded()


def keep_saved_scalar_dtypes(optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]) -> None:
    """Undo one cast of torch's ``load_state_dict``, which gives every floating state value
    its parameter's dtype: a scalar torch keeps in another dtype (NAdam's float32
    ``mu_product`` beside float64 parameters) goes back to the saved dtype, so a resumed
    run rounds as the uninterrupted one did."""
    # torch maps the saved ids to parameters in group order, whatever the ids are
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in sd.get("param_groups", []) for i in g.get("params", [])]
    by_id = dict(zip(saved, params, strict=False))
    for idx, entries in sd.get("state", {}).items():
        if idx not in by_id:
            continue
        live = optimizer.state.get(by_id[idx])
        if not isinstance(live, dict) or not isinstance(entries, Mapping):
            continue
        for key, saved in entries.items():
            cur = live.get(key)
            if (
                key != "step"
                and isinstance(saved, torch.Tensor)
                and isinstance(cur, torch.Tensor)
                and saved.dim() == 0
                and saved.dtype != cur.dtype
            ):
                live[key] = saved.to(cur.device).clone()


def _fused_sgd_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return supported_name(optimizer) == "SGD" and any(
        g.get("fused") and g.get("momentum", 0) != 0 for g in _quiet_groups(optimizer)
    )


def align_fused_sgd(optimizer: torch.optim.Optimizer, param: Any = None) -> None:
    """Give every parameter of the fused SGD-with-momentum group that holds the paged
    ``param`` (every such group if None) a momentum buffer.

    A paged table's rows always carry one (a fresh row's is zero), and torch's fused SGD
    takes buffers for all of a group's parameters or for none (its first step). A zero
    buffer gives exactly torch's first step when ``dampening`` is 0 (``buf = grad``);
    with ``dampening`` != 0 there is no exact equivalent, so that case is refused. Groups
    without a paged parameter are torch's own business (each group is one fused call).

    Raises
    ------
    GadgetValueError
        A fused SGD group with ``dampening`` != 0 holds a paged parameter beside
        parameters without a buffer.
    """
    state = optimizer.state
    for group in _quiet_groups(optimizer):
        if not group.get("fused") or group.get("momentum", 0) == 0:
            continue
        if param is not None and not any(p is param for p in group["params"]):
            continue
        missing = [p for p in group["params"] if state.get(p, {}).get("momentum_buffer") is None]
        if not missing:
            continue
        if group.get("dampening", 0) != 0:
            raise GadgetValueError(
                "SGD(fused=True, momentum != 0, dampening != 0) cannot train offloaded tables "
                "beside ordinary parameters in one parameter group (torch's fused SGD needs "
                "momentum buffers for all of a group's parameters or none, and a zero buffer "
                "differs from torch's first step when dampening != 0); put the tables in a "
                "group of their own, or use fused=False, or dampening=0"
            )
        for p in missing:
            state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def interleave_ok(
    table: DataGadget, placement: str, num_rows: int, row_shape: tuple[int, ...], dtypes: list[Any]
) -> bool:
    """Whether ``table`` and state tables of ``dtypes`` can share one buffer: at least one
    state, all in host RAM (``pinned`` or ``cpu``, the same placement as the table),
    the table's dtype and shape."""
    from .._device import resolve_placement
    from ..stores import CpuStore, PinnedStore, SlotStore

    store = table.store
    if not dtypes or store.closed or not isinstance(store, (PinnedStore, CpuStore, SlotStore)):
        return False
    where = store.placement
    return (
        where in ("pinned", "cpu")
        # (the fallback warning, once per process, also when the table was asked for 'cpu')
        and resolve_placement(placement) == where
        and all(d == table.dtype for d in dtypes)
        and table.shape == (num_rows, *row_shape)
    )


def _interleave_with(
    table: DataGadget,
    placement: str,
    num_rows: int,
    row_shape: tuple[int, ...],
    dtypes: list[Any],
    device: torch.device,
) -> list[Store] | None:
    """Move ``table`` into slot 0 of a new interleaved buffer and return the state slots
    (zero-filled), or None where :func:`interleave_ok` says no."""
    from ..stores import interleaved_stores, standalone_copy
    from ..stores._interleaved import slot_info

    info = slot_info(table.store)
    if info is not None and info[0].open == {info[1]}:
        # the table is still in the buffer of an optimizer that is gone (its state slots
        # were released): take it out first, so that buffer (the table's size times one
        # plus the states) is freed now rather than kept for good or held beside a new one
        table._replace_store(standalone_copy(table.store))
    if not interleave_ok(table, placement, num_rows, row_shape, dtypes):
        return None
    old = table.store
    slots = interleaved_stores(
        old.placement,
        num_rows,
        row_shape,
        table.dtype,
        1 + len(dtypes),
        old.cuda_device if old.cuda_device is not None else None,
    )
    try:
        old.synchronize()  # GPU writes into the old table (an initializer) have landed
        src, dst = old.host_view(), slots[0].host_view()
        assert src is not None and dst is not None
        step = max(1, (256 << 20) // max(1, old.row_nbytes))
        for start in range(0, num_rows, step):  # bounded blocks; torch's threads copy each
            dst[start : start + step].copy_(src[start : start + step])
        table._replace_store(slots[0])
    except BaseException:
        for s in slots:
            s.close()
        raise
    return list(slots[1:])


def resolve_named_parameter(model: torch.nn.Module, variable_name: str) -> torch.nn.Parameter:
    """``model.<variable_name>.weight`` (SpeedTorch's convention) or the parameter of that name.

    Raises
    ------
    GadgetKeyError
        When no such variable exists; the message lists the model's variables.
    """
    if not isinstance(model, torch.nn.Module):
        raise GadgetTypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if not isinstance(variable_name, str):
        raise GadgetTypeError(
            "variable_name must be a string (the attribute name of the embedding module); "
            f"got {type(variable_name).__name__} {variable_name!r:.40}"
        )
    params = dict(model.named_parameters())
    for name in (f"{variable_name}.weight", variable_name):
        if name in params:
            return params[name]
    known = sorted({n.removesuffix(".weight") for n in params})
    raise GadgetKeyError(
        f"the model has no variable named {variable_name!r}; expected one of {known} "
        "(the attribute name of the embedding module, e.g. 'u_embeddings')"
    )


class OptimizerSwitch:
    """Pages one model variable's optimizer state between full tables and the optimizer.

    The implementation behind ``OptimizerFactory`` and ``PytorchOptimizerFactory``.
    It follows the row layout of the :class:`~gadgetloader.switching.ModelSwitch`
    of the same variable (merged or separate duplicates), so both always agree.

    Parameters
    ----------
    given_optimizer : torch.optim.Optimizer
        The optimizer built over the model's parameters; one of
        :data:`SUPPORTED_OPTIMIZERS`, with any foreach / fused / capturable setting.
    total_classes, embed_dimension : int
        The full table's shape.
    model : nn.Module
        The model holding the variable.
    variable_name : str
        The variable's attribute name in the model (``'u_embeddings'``).
    dtype : str or dtype, optional
        Dtype of the state tables (default: the state's own dtype).
    placement : {'pinned', 'cuda', 'cpu'}, optional
        Where the state tables live (default as for :class:`ModelSwitch`: ``pinned``
        where CUDA is available, else ``cpu`` silently).
    """

    def __init__(
        self,
        given_optimizer: torch.optim.Optimizer,
        total_classes: int,
        embed_dimension: int,
        model: torch.nn.Module,
        variable_name: str,
        *,
        dtype: Any = None,
        placement: str | None = None,
    ) -> None:
        if placement is None:
            placement = "pinned" if cuda_available() else "cpu"
        from .._dtypes import as_torch_dtype, dtype_name
        from ._rows import check_training_placement

        check_training_placement(placement, type(self).__name__)
        self.optimizer_name = supported_name(given_optimizer)
        self.optimizer = given_optimizer
        self.param = resolve_named_parameter(model, variable_name)
        _group_of(given_optimizer, self.param)
        self.total_classes = as_count(total_classes, "total_classes")
        self.embed_dimension = as_count(embed_dimension, "embed_dimension")
        row_shape = tuple(self.param.shape[1:])
        if row_shape != (self.embed_dimension,):
            raise GadgetValueError(
                f"embed_dimension={embed_dimension} but {variable_name!r} has rows of shape {row_shape}"
            )
        self.variable_name = variable_name
        self._dtype = as_torch_dtype(dtype) if dtype is not None else None
        if self._dtype is not None and not self._dtype.is_floating_point:
            raise GadgetTypeError(
                f"dtype {dtype_name(self._dtype)!r}: optimizer state tables must be "
                "floating point (float32, float64, float16 or bfloat16); an integer or bool "
                "table would round the state away at every write-back"
            )
        self._placement = placement
        self.pager: StatePager | None = None
        self._own_cache = PlanCache()

    def __repr__(self) -> str:
        keys = list(self.pager.row_keys) if self.pager is not None else "(call optInit)"
        return f"{type(self).__name__}({self.optimizer_name}, variable={self.variable_name!r}, state={keys})"

    @property
    def tables(self) -> dict[str, DataGadget]:
        """The state tables by state name (after :meth:`optInit`)."""
        return dict(self._need_pager().tables)

    # ---- whole state tables (SpeedTorch's names) ------------------------------------
    def getNumpyVersion(self) -> dict[str, np.ndarray]:
        """Every state table as a NumPy array, by state name (e.g. ``exp_avg``)."""
        return {k: t.getNumpyVersion() for k, t in self._need_pager().tables.items()}

    def customInit(self, initFunction: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Fill every state table with an in-place torch initializer, e.g.
        ``customInit(torch.nn.init.constant_, 0.1)`` for an Adagrad accumulator:
        ``initFunction(tensor, *args, **kwargs)`` on each table's rows."""
        if not callable(initFunction):
            raise GadgetTypeError(
                "customInit takes a function that fills a tensor in place (e.g. "
                f"torch.nn.init.constant_); got {type(initFunction).__name__}"
            )
        pager = self._need_pager()
        for t in pager.tables.values():
            t.init_(initFunction, *args, **kwargs)
        pager.tables_written()

    def saveTorch(self, saveFileName: str | os.PathLike[str]) -> None:
        """Save the state tables to ``saveFileName`` with ``torch.save`` as ``{state name: CPU tensor}``,
        atomically (a save that fails part-way leaves any previous file whole)."""
        tables = self._need_pager().tables
        save_torch_file({k: table_tensor(t) for k, t in tables.items()}, saveFileName)

    def loadTorch(self, loadFileName: str | os.PathLike[str]) -> None:
        """Load state tables saved with :meth:`saveTorch` from ``loadFileName``: a ``{state name: tensor}`` dict,
        or (SpeedTorch's layout) a list of tensors in :attr:`tables` order. Names and shapes
        must match; a tensor of another floating dtype is taken where every value converts
        exactly, any other dtype is refused. Everything is checked before any table is
        written."""
        tables = self._need_pager().tables
        path = as_path(loadFileName)
        got = load_torch_file(path)
        if isinstance(got, (list, tuple)):
            if len(got) != len(tables):
                raise GadgetValueError(
                    f"{path} holds {len(got)} tensors; this optimizer has {len(tables)} state "
                    f"tables {list(tables)}"
                )
            got = dict(zip(tables, got, strict=True))
        if not isinstance(got, dict) or set(got) != set(tables):
            names = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise GadgetValueError(f"{path} holds state tables {names}; expected {sorted(tables)}")
        checked = {
            k: check_tensor(got[k], f"{path}[{k!r}]", t.shape, t.dtype) for k, t in tables.items()
        }
        for k, t in tables.items():
            t.store.check_open()  # a closed state table: refused before any is written
            t._check_no_waiting_lookup(f"loadTorch into the state table {k!r}")
        try:
            for k, t in tables.items():
                t.store.write_block(0, checked[k])
                t.store.synchronize()
        finally:
            for t in tables.values():
                t._wrote()
        self._need_pager().tables_written()

    def optInit(self) -> None:
        """Create the state tables, filled as torch initialises a fresh parameter's state.

        Where the model switcher's table lives in host RAM (``pinned`` / ``cpu``) with
        the states' placement and dtype, the table moves into one buffer with its state
        tables, rows side by side (see :class:`StatePager`). The model switcher's
        ``beforeForwardPass`` then gathers each row's state with the row, and its
        ``afterOptimizerStep`` writes both back (this switcher's own calls then find
        the work done); the protocol and the results are unchanged."""
        from ._model import switch_for

        sw = switch_for(self.param)
        if sw is not None and sw.total_classes != self.total_classes:
            raise GadgetValueError(
                f"this optimizer switcher has total_classes={self.total_classes} but the model "
                f"switcher of {self.variable_name!r} has {sw.total_classes}; they must match"
            )
        if self.pager is not None:
            for t in self.pager.tables.values():
                t.close()
            _PAGERS.get(self.param, weakref.WeakSet()).discard(self.pager)
        self.pager = StatePager(
            self.optimizer,
            self.param,
            self.total_classes,
            placement=self._placement,
            dtype=self._dtype,
            table=sw.table if sw is not None else None,
        )
        self.pager.guarded = True
        _PAGERS.setdefault(self.param, weakref.WeakSet()).add(self.pager)
        if sw is not None:
            # interleaved: the model switcher moves each row's state with the row itself
            sw._pager = self.pager if self.pager.interleaved else None

    def _need_pager(self) -> StatePager:
        if self.pager is None:
            raise GadgetValueError("call optInit() before using the optimizer switcher")
        self.pager.follow_hyper()  # state a scheduler turned on has its table (see StatePager)
        return self.pager

    def _plan(self, pos: Any, neg: Any) -> RowPlan:
        from ._model import _as_id_parts, switch_for
        from ._rows import plan_rows

        sw = switch_for(self.param)
        if sw is not None:
            return sw.plan(pos, neg)
        cached = self._own_cache.get(pos, neg)
        if cached is not None:
            return cached
        plan = plan_rows(
            _as_id_parts(pos, neg, self.total_classes, self.param.device),
            "merge",
            self.total_classes,
        )
        self._own_cache.put(pos, neg, plan)
        return plan

    def beforeForwardPass(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Gather these ids' state rows into the optimizer's state for the variable:
        ``retrievedPosIndexes`` and ``retrievedNegIndexes`` as for
        :meth:`ModelSwitch.beforeForwardPass` (the same ids as the model switcher's)."""
        from ._model import switch_for

        pager = self._need_pager()
        sw = switch_for(self.param)
        if sw is None:
            self._own_cache.clear()  # a step starts from the ids as they are now
        elif not sw._in_step:
            # called before the model switcher in this step: its plan of the last step must
            # not be reused (an id buffer refilled through CuPy keeps torch's version)
            sw._cache.clear()
        plan = self._plan(retrievedPosIndexes, retrievedNegIndexes)
        prefetched = sw.take_prefetched(plan) if sw is not None else None
        pager.load(
            plan,
            sw.capacity_for(plan) if sw is not None else int(plan.local.numel()),
            prefetched=prefetched,
        )
        pager.step_pending = torch.is_grad_enabled()  # (a lookup under no_grad starts none)

    def afterOptimizerStep(self, retrievedPosIndexes: Any, retrievedNegIndexes: Any = None) -> None:
        """Scatter the updated state rows back into the tables (unless the model switcher's
        ``afterOptimizerStep`` already wrote them with the rows, see ``optInit``);
        ``retrievedPosIndexes`` and ``retrievedNegIndexes`` are the ids given to this step's
        :meth:`beforeForwardPass`."""
        from ._model import switch_for

        pager = self._need_pager()
        plan = self._plan(retrievedPosIndexes, retrievedNegIndexes)
        loaded = pager.loaded_plan
        sw = switch_for(self.param)
        model_loaded = sw._loaded if sw is not None else None
        if (
            loaded is None
            or not same_rows(plan, loaded)
            or (model_loaded is not None and not same_rows(plan, model_loaded))
        ):
            # the state rows would land on other rows than they were read from
            raise GadgetValueError(
                "afterOptimizerStep got ids other than those its beforeForwardPass loaded "
                f"(here {rows_preview(plan)}; loaded {rows_preview(loaded)}"
                + (
                    ""
                    if model_loaded is None
                    else f"; in the model switcher {rows_preview(model_loaded)}"
                )
                + "); pass the same ids to both switchers' beforeForwardPass and afterOptimizerStep"
            )
        if pager.interleaved and pager.stored_plan is plan:
            return
        pager.check_unchanged()
        pager.store_back(plan)
