"""Shared benchmark machinery: timing with CUDA events, the memcpy ceiling, tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import GadgetValueError

__all__ = [
    "OptionError",
    "Timing",
    "comma_list",
    "format_table",
    "gbps",
    "measure_memcpy",
    "non_negative_int",
    "positive_float",
    "learning_rate",
    "non_negative_finite_float",
    "positive_finite_float",
    "positive_int",
    "time_fn",
]


#: the largest count or seed a benchmark option takes: torch's sizes and generator seeds
#: are 64-bit signed (a training benchmark seeds its tables with seed + k, too)
MAX_OPTION_INT = 2**63 - 1


def _bounded_int(text: str, low: int, high: int = MAX_OPTION_INT) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a number of at least {low}, got {value}")
    if value > high:
        raise argparse.ArgumentTypeError(
            f"expected a number of at most {high} (2**63 - 1 for counts), got {value}"
            if high == MAX_OPTION_INT
            else f"expected a number of at most {high}, got {value}"
        )
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (and at most 2**63 - 1)."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0 (and at most 2**63 - 1)."""
    return _bounded_int(text, 0)


def table_dtype(text: str) -> str:
    """An argparse type for ``--dtype``: a dtype a table can have (its name, as given)."""
    import argparse

    from .._dtypes import as_torch_dtype

    try:
        as_torch_dtype(text)
    except Exception:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a table dtype (float16, bfloat16, float32, float64, int8, "
            "int16, int32, int64, uint8, bool)"
        ) from None
    return text


def seed_int(text: str) -> int:
    """An argparse type for ``--seed``: 0 up to 2**62 (every suite derives a few more
    seeds from it, and torch's generators take signed 64-bit seeds)."""
    return _bounded_int(text, 0, 2**62)


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no inf or nan)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def positive_finite_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    import argparse

    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


#: The largest learning rate the CLIs take: Adam's first float32 step is ``lr / (1 - beta1)``
#: (ten times ``lr``), which overflows float32 (3.4e38) a little above 3e37.
MAX_LEARNING_RATE = 1e30


def learning_rate(text: str) -> float:
    """An argparse type: a learning rate above 0 and at most :data:`MAX_LEARNING_RATE`."""
    import argparse

    value = positive_finite_float(text)
    if value > MAX_LEARNING_RATE:
        raise argparse.ArgumentTypeError(
            "expected a learning rate of at most 1e30 (float32 optimizer "
            f"steps overflow beyond), got {text}"
        )
    return value


def non_negative_finite_float(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    import argparse

    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text}")
    return value


class OptionError(GadgetValueError):
    """A bad value of a command-line option found after parsing (a name list, a bound that
    depends on another option, a folder): ``gadgetloader`` reports it as argparse reports
    its own, a usage error naming the command, exit status 2."""


def comma_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """``text``'s comma-separated names, each one of ``allowed`` (else an :class:`OptionError`)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise OptionError(
            f"unknown {what} {bad or [text]}; expected a comma-separated subset of {list(allowed)}"
        )
    return names


class Timing(dict):  # type: ignore[type-arg]
    """``{'ms': median, 'min_ms': ..., 'runs': n}``."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3) -> Timing:
    """Median wall time of ``fn`` in ms; device work is bracketed by CUDA events
    (or a synchronize and the host clock on the CPU). Host-side work inside ``fn``
    that blocks is included, as a user would see it."""
    for _ in range(warmup):
        fn()
    _sync()
    times: list[float] = []
    use_events = torch.cuda.is_available()
    for _ in range(repeats):
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(ms=statistics.median(times), min_ms=min(times), runs=len(times))


def gbps(nbytes: int, ms: float) -> float:
    """GB/s (10^9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def measure_memcpy(nbytes: int = 1 << 30, *, repeats: int = 10) -> dict[str, float]:
    """Pinned host<->device ``copy_`` bandwidth in GB/s (the link's practical limit).

    Returns an empty dict where CUDA is missing.
    """
    if not torch.cuda.is_available():
        return {}
    n = max(1, nbytes // 4)
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.uniform_()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    h2d = time_fn(lambda: dev.copy_(host, non_blocking=True), repeats=repeats)
    d2h = time_fn(lambda: host.copy_(dev, non_blocking=True), repeats=repeats)
    return {
        "bytes": n * 4,
        "h2d_GBps": gbps(n * 4, h2d["ms"]),
        "d2h_GBps": gbps(n * 4, d2h["ms"]),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (also valid GitHub markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:  # NaN
            return "-"
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return "-" if c is None else str(c)
